// Package wrapper is the process that runs inside a sandbox, one per runtime
// key (`agentplane wrapper`, `sandbox wrapper`). It keeps a control stream
// to the sandbox service's WrapperControlService with its launch credential
// (package control), supervises ONE runtime process in its own process group
// through a runtime driver (JSON lines for the scripted runtime, package
// jsonl; ACP agents, package acp), and multiplexes the routes (sessions) of
// its runtime key over it (docs/runtime-protocol.md).
//
// The launch credential is read from an inherited file descriptor (or a 0600
// file deleted after reading), never from the environment or command line.
// Past the reconnect window without the control plane, or on Shutdown, the
// wrapper stops its runtime's process group and exits.
package wrapper

import (
	"agentplane.dev/pkg/telemetry"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/pkg/nodump"
	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
	"agentplane.dev/services/sandbox/internal/network/egresshandoff"
	"agentplane.dev/services/sandbox/internal/network/socketrelay"
	"agentplane.dev/services/sandbox/internal/node/boundary"
	"agentplane.dev/services/sandbox/internal/node/provider"
	"agentplane.dev/services/sandbox/wrapper/acp"
	"agentplane.dev/services/sandbox/wrapper/control"
	"agentplane.dev/services/sandbox/wrapper/jsonl"
	"agentplane.dev/services/sandbox/wrapper/runtimedriver"
)

// ProtocolVersion is the wrapper protocol this build speaks.
const ProtocolVersion = 1

// CapabilityWorktree announces one runtime per directory.
const CapabilityWorktree = "worktree"

// Exit codes.
const (
	ExitOK          = 0 // shutdown requested (including a rejected Hello)
	ExitUsage       = 2
	ExitUnreachable = 3 // reconnect window passed without the control plane
)

// Env names for settings that tests and operators shorten.
const (
	EnvControlAddr      = "AGENTPLANE_WRAPPER_CONTROL_ADDR"
	EnvReconnectWindow  = "AGENTPLANE_WRAPPER_RECONNECT_WINDOW"
	EnvAgentInitTimeout = "AGENTPLANE_WRAPPER_AGENT_INIT_TIMEOUT"
)

// Options configure a wrapper.
type Options struct {
	ControlAddrs    []string
	Markers         provider.Markers
	AllocationID    string
	FenceToken      uint64
	Credential      string
	WorkspaceRoot   string
	Capabilities    []string
	Heartbeat       time.Duration
	ReconnectWindow time.Duration
	RuntimeCommand  []string
	// Runtime starts the agent runtime; nil: RuntimeCommand as JSON lines.
	Runtime runtimedriver.Starter
	// Agent is the profile this wrapper runs (docs/runtime-protocol.md);
	// a route asking for another fails with agent_mismatch.
	Agent string
	// RuntimeSpec is the resolved profile (--runtime-spec); an ACP one is
	// driven by package acp, with AgentInitTimeout bounding its start.
	RuntimeSpec      agents.Spec
	AgentInitTimeout time.Duration
	Logger           *slog.Logger
	// MaxRepoBytes bounds a clone on disk (REPO_TOO_LARGE); 0: no bound.
	MaxRepoBytes int64

	// Behind the boundary (set by the sandbox service when isolated):
	// ControlDir holds every local replica's control socket, tried after
	// ControlAddrs; ProxyListen is the loopback address where the runtime
	// finds the credential proxy, relayed to a socket of ProxyDir;
	// OTLPDir holds the sockets its spans leave through (relayed to the
	// collector); Contained says the wrapper is in its own PID namespace,
	// so on the way out it ends everything left in it.
	ControlDir  string
	ProxyListen string
	ProxyDir    string
	OTLPDir     string
	// EgressListen is the loopback address of the egress proxy (the
	// runtime's HTTP_PROXY and HTTPS_PROXY): each connection is handed to
	// a socket of EgressDir with this wrapper's preamble.
	EgressListen string
	EgressDir    string
	Contained    bool
	Limits       boundary.Limits
	// Nest runs the runtime in the agent's nested sandbox (--nest-bwrap).
	Nest *runtimedriver.Nest
	// Claim, when set, makes this a pooled wrapper (--claim-fd, DESIGN.md
	// 3.8): it starts its runtime bound to no sandbox and waits for the
	// identity it serves (provider.Claim) before it talks to any service;
	// the descriptor closing without one ends it. It says it is ready on
	// the same descriptor (provider.WriteReady) once its runtime started.
	Claim io.ReadWriter
}

// Main parses args, reads the launch credential and runs the wrapper until it
// is told to shut down or gives up on the control plane.
func Main(args []string) int {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil)).With("component", "wrapper")
	opts, err := parse(args)
	if err != nil {
		log.Error("bad wrapper arguments", "err", err)
		return ExitUsage
	}
	// Limits first: everything the wrapper starts inherits them, and
	// nothing inside can raise a hard limit again.
	if err := opts.Limits.Apply(); err != nil {
		log.Error("cannot apply the sandbox's limits", "err", err)
		return ExitUsage
	}
	opts.Logger = log.With("sandbox", opts.Markers.SandboxID, "runtime_key", opts.Markers.RuntimeKey, "instance", opts.Markers.InstanceID)
	if opts.Runtime == nil {
		opts.Runtime = runtimeStarter(opts)
	}
	// Tracing from the OTEL_* the sandbox service passes on (opt-in, like the services').
	var telOpts []telemetry.Option
	if opts.OTLPDir != "" {
		telOpts = append(telOpts, telemetry.WithDialer(func(context.Context, string) (net.Conn, error) { return socketrelay.DialDir(opts.OTLPDir) }))
	}
	tel, err := telemetry.Setup(context.Background(), "agentplane-wrapper", telOpts...)
	if err != nil {
		log.Error("bad tracing environment", "err", err)
		return ExitUsage
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tel.Shutdown(ctx)
	}()
	// SIGTERM (the provider's stop) stops the runtime first, then exits.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return Run(ctx, opts)
}

func parse(args []string) (Options, error) {
	fs := flag.NewFlagSet("wrapper", flag.ContinueOnError)
	var (
		addrs     = fs.String("control-addr", os.Getenv(EnvControlAddr), "sandbox service gRPC address(es), comma separated")
		alloc     = fs.String("allocation", "", "allocation id the wrapper was launched for")
		fenceTok  = fs.Uint64("fence-token", 0, "fencing token of the sandbox owner that launched the wrapper")
		credFD    = fs.Int("credential-fd", -1, "inherited file descriptor holding the launch credential")
		credFile  = fs.String("credential-file", "", "0600 file holding the launch credential; deleted after reading")
		claimFD   = fs.Int("claim-fd", -1, "pooled: inherited file descriptor on which the sandbox service sends the identity this wrapper serves (instead of --allocation, --fence-token and the launch credential)")
		root      = fs.String("workspace-root", "", "directory under which route directories are mapped; empty: the working directory the provider prepared")
		caps      = fs.String("capabilities", CapabilityWorktree, "comma separated capabilities to announce")
		heartbeat = fs.Duration("heartbeat", 5*time.Second, "heartbeat interval (HelloAck may change it)")
		window    = fs.Duration("reconnect-window", envDuration(EnvReconnectWindow, 90*time.Second), "how long to stay disconnected before stopping the runtime and exiting")
		spec      = fs.String("runtime-spec", "", "the agent profile to run, as the sandbox service resolved it (JSON, no secrets); empty: the scripted runtime")
		initWait  = fs.Duration("agent-init-timeout", envDuration(EnvAgentInitTimeout, 2*time.Minute), "bound on an ACP agent's initialize and each session/new or session/load")
		maxRepo   = fs.Int64("max-repo-bytes", 10<<30, "largest repository clone on disk, in bytes (route failed(repo_too_large) above it); 0: no bound")
		ctlDir    = fs.String("control-dir", "", "directory of control sockets (unix) to try after --control-addr")
		proxyLn   = fs.String("proxy-listen", "", "loopback address where the runtime reaches the credential proxy (relayed to --proxy-dir)")
		proxyDir  = fs.String("proxy-dir", "", "directory of Unix sockets leading to the credential proxy")
		otlpDir   = fs.String("otlp-dir", "", "directory of Unix sockets leading to the OTLP collector (behind the boundary)")
		egressLn  = fs.String("egress-listen", "", "loopback address where the runtime reaches the egress proxy (each connection handed to --egress-dir)")
		egressDir = fs.String("egress-dir", "", "directory of Unix sockets leading to the egress proxy")
		contained = fs.Bool("contained", false, "the wrapper runs in its own PID namespace: on exit, end every process left in it; the wrapper makes itself non-dumpable")
		nestBwrap = fs.String("nest-bwrap", "", "run the runtime in a nested sandbox made by this bubblewrap, out of reach of the wrapper")
		rlimits   = fs.String("rlimits", "", "resource limits to apply before starting the runtime, e.g. nofile=1024,nproc=512,as=68719476736,fsize=4294967296,cpu=14400")
	)
	if err := fs.Parse(args); err != nil {
		return Options{}, err
	}
	o := Options{
		ControlAddrs: splitList(*addrs), AllocationID: *alloc, FenceToken: *fenceTok,
		WorkspaceRoot: *root, Capabilities: splitList(*caps), Heartbeat: *heartbeat, ReconnectWindow: *window,
		RuntimeCommand: fs.Args(), Agent: agents.Scripted, MaxRepoBytes: *maxRepo,
		ControlDir: *ctlDir, ProxyListen: *proxyLn, ProxyDir: *proxyDir, OTLPDir: *otlpDir, Contained: *contained,
		EgressListen: *egressLn, EgressDir: *egressDir,
	}
	if *nestBwrap != "" {
		o.Nest = &runtimedriver.Nest{Bwrap: *nestBwrap}
	}
	if *spec != "" {
		s, err := agents.ParseSpec(*spec)
		if err != nil {
			return Options{}, err
		}
		o.Agent, o.RuntimeSpec, o.AgentInitTimeout = s.Profile, s, *initWait
	}
	lim, err := boundary.ParseLimits(*rlimits)
	if err != nil {
		return Options{}, err
	}
	o.Limits = lim
	o.Markers = markersFromEnv()
	if o.Claim, err = claimFile(*claimFD); err != nil {
		return Options{}, err
	}
	if err := o.checkLaunch(); err != nil {
		return Options{}, err
	}
	if len(o.RuntimeCommand) == 0 {
		self, err := os.Executable()
		if err != nil {
			return Options{}, err
		}
		o.RuntimeCommand = []string{self, "runtime", "scripted"}
	}
	if err := o.takeCredential(*credFD, *credFile); err != nil {
		return Options{}, err
	}
	return o, nil
}

// takeCredential reads the launch credential (a pooled wrapper's comes
// with its claim), made non-dumpable first when contained: a
// non-dumpable process's /proc files belong to a root the sandbox's user
// namespace does not map, so nothing of the sandbox's uid reads its memory
// or environment, nor traces it. (Without the boundary the wrapper is the
// anchor whose markers its service reads: it stays dumpable.)
func (o *Options) takeCredential(fd int, file string) error {
	if o.Contained {
		if err := nodump.Set(); err != nil {
			return err
		}
	}
	if o.Claim != nil {
		return nil
	}
	cred, err := readCredential(fd, file)
	o.Credential = cred
	return err
}

// claimFile opens a pooled wrapper's inherited claim descriptor (nil for
// fd < 0), close-on-exec before anything starts: the runtime starts before
// the claim arrives, and must never hold the descriptor that carries the launch
// credential.
func claimFile(fd int) (io.ReadWriter, error) {
	if fd < 0 {
		return nil, nil
	}
	syscall.CloseOnExec(fd)
	f := os.NewFile(uintptr(fd), "claim")
	if f == nil {
		return nil, fmt.Errorf("claim fd %d is not open", fd)
	}
	return f, nil
}

// markersFromEnv reads the markers the provider set in the wrapper's
// environment (sandbox, runtime key, instance, generation).
func markersFromEnv() provider.Markers {
	gen, _ := strconv.ParseUint(os.Getenv(provider.EnvGeneration), 10, 64)
	return provider.Markers{
		SandboxID: os.Getenv(provider.EnvSandbox), RuntimeKey: os.Getenv(provider.EnvRuntimeKey),
		InstanceID: os.Getenv(provider.EnvInstance), Generation: gen,
	}
}

// checkLaunch checks that the parsed options can launch a wrapper: the
// relay flags in pairs, the control addresses, allocation and markers
// present, and each control address one the sandbox service would accept.
func (o *Options) checkLaunch() error {
	if (o.ProxyListen == "") != (o.ProxyDir == "") {
		return errors.New("--proxy-listen and --proxy-dir go together")
	}
	if (o.EgressListen == "") != (o.EgressDir == "") {
		return errors.New("--egress-listen and --egress-dir go together")
	}
	if len(o.ControlAddrs) == 0 || o.Markers.SandboxID == "" || o.Markers.RuntimeKey == "" || o.Markers.InstanceID == "" {
		return errors.New("need --control-addr and the AGENTPLANE_SANDBOX/RUNTIME_KEY/INSTANCE markers")
	}
	if (o.AllocationID == "") == (o.Claim == nil) {
		return errors.New("need exactly one of --allocation (launched for a runtime key) and --claim-fd (pooled)")
	}
	for _, a := range o.ControlAddrs {
		// The same check the sandbox service applies to SANDBOX_CONTROL_ADDRS.
		if _, err := grpcclient.ParseTarget(a); err != nil {
			return fmt.Errorf("--control-addr entry %q: %w", a, err)
		}
	}
	return nil
}

// readCredential reads the launch credential from an inherited fd or a file
// that is removed right after reading.
func readCredential(fd int, file string) (string, error) {
	var r io.ReadCloser
	switch {
	case fd >= 0:
		f := os.NewFile(uintptr(fd), "launch-credential")
		if f == nil {
			return "", fmt.Errorf("credential fd %d is not open", fd)
		}
		r = f
	case file != "":
		f, err := os.Open(file)
		if err != nil {
			return "", fmt.Errorf("open credential file: %w", err)
		}
		_ = os.Remove(file)
		r = f
	default:
		return "", errors.New("need --credential-fd or --credential-file")
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, 4096))
	if err != nil {
		return "", fmt.Errorf("read launch credential: %w", err)
	}
	cred := strings.TrimSpace(string(b))
	if cred == "" {
		return "", errors.New("empty launch credential")
	}
	return cred, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func envDuration(name string, def time.Duration) time.Duration {
	if v, ok := os.LookupEnv(name); ok {
		if d, err := time.ParseDuration(v); err == nil && d > 0 {
			return d
		}
	}
	return def
}

// routeState is one session served by this wrapper.
type routeState struct {
	directory        string
	runtimeSessionID string
	ready            bool
	git              gitRoute // the route's repository and proxy access
}

type wrapper struct {
	opts    Options
	log     *slog.Logger
	control *control.Stream

	mu      sync.Mutex
	routes  map[string]*routeState
	runtime runtimedriver.Runtime
	stopped bool // the wrapper is ending: no runtime starts any more
	busy    map[string]bool
	// unclaimed, for a pooled wrapper, closes if its runtime ends before
	// the claim (nil once claimed, and for a wrapper launched for a key).
	unclaimed chan struct{}
}

// Run runs the wrapper until shutdown or the reconnect window passes
// (zero Heartbeat and ReconnectWindow: control's defaults).
func Run(ctx context.Context, opts Options) int {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Runtime == nil {
		opts.Runtime = runtimeStarter(opts)
	}
	w := &wrapper{opts: opts, log: opts.Logger, routes: map[string]*routeState{}, busy: map[string]bool{}}
	w.control = control.New(control.Config{Addrs: w.controlAddrs, Heartbeat: opts.Heartbeat,
		ReconnectWindow: opts.ReconnectWindow, Logger: opts.Logger}, w)
	if opts.RuntimeSpec.Protocol == agents.ProtocolACP {
		// A real agent takes seconds to start: start it now, alongside
		// the Hello and the handle mint, not after the first PrepareRoute.
		// A failed start is retried (and reported) by that PrepareRoute.
		go func() { _ = w.startRuntime() }()
	}
	if opts.Claim != nil {
		// Pooled: the runtime starts now, bound to nothing; one that
		// cannot start, or ends before the claim, ends the wrapper (the
		// pool replaces it).
		w.unclaimed = make(chan struct{})
		if err := w.startRuntime(); err != nil {
			w.log.Error("pooled wrapper cannot start its runtime", "err", err)
			close(w.unclaimed)
		} else if err := provider.WriteReady(opts.Claim); err != nil {
			w.log.Warn("pooled wrapper cannot say it is ready", "err", err)
		}
	}
	if opts.Claim != nil && !w.claimed(ctx) {
		w.stopRuntime()
		if opts.Contained {
			endNamespace(w.log)
		}
		return ExitOK
	}
	opts = w.opts
	if opts.ProxyListen != "" {
		ln, err := net.Listen("tcp", opts.ProxyListen)
		if err != nil {
			w.log.Error("cannot offer the proxy inside the sandbox", "addr", opts.ProxyListen, "err", err)
			return ExitUsage
		}
		relayed := make(chan struct{})
		go func() {
			socketrelay.Serve(ln, func() (net.Conn, error) { return socketrelay.DialDir(opts.ProxyDir) })
			close(relayed)
		}()
		defer func() { _ = ln.Close(); <-relayed }()
	}
	if opts.EgressListen != "" {
		ln, err := net.Listen("tcp", opts.EgressListen)
		if err != nil {
			w.log.Error("cannot offer the egress proxy inside the sandbox", "addr", opts.EgressListen, "err", err)
			return ExitUsage
		}
		id := egresshandoff.Identity{SandboxID: opts.Markers.SandboxID, Instance: opts.Markers.InstanceID, Credential: opts.Credential}
		relayed := make(chan struct{})
		go func() {
			// Each connection is handed to the proxy, socket and all: the
			// wrapper carries none of its bytes.
			socketrelay.Accept(ln, egresshandoff.Handler(opts.EgressDir, id))
			close(relayed)
		}()
		defer func() { _ = ln.Close(); <-relayed }()
	}
	code := ExitOK
	if w.control.Run(ctx) == control.Unreachable {
		code = ExitUnreachable
	}
	w.stopRuntime()
	if opts.Contained {
		endNamespace(w.log)
	}
	return code
}

// claimed waits for a pooled wrapper's claim and takes on its identity;
// false when the pool let it go (or the wrapper is told to stop) first.
func (w *wrapper) claimed(ctx context.Context) bool {
	w.mu.Lock()
	unclaimed := w.unclaimed
	w.mu.Unlock()
	got := make(chan struct{})
	var c provider.Claim
	var err error
	go func() {
		c, err = provider.ReadClaim(w.opts.Claim)
		close(got)
	}()
	select {
	case <-ctx.Done():
		return false
	case <-unclaimed:
		w.log.Warn("pooled wrapper's runtime ended before a claim")
		return false
	case <-got:
	}
	if closer, ok := w.opts.Claim.(io.Closer); ok {
		_ = closer.Close()
	}
	if err != nil {
		if !errors.Is(err, provider.ErrNoClaim) {
			w.log.Error("pooled wrapper got no usable claim", "err", err)
		}
		return false
	}
	w.mu.Lock()
	w.unclaimed = nil
	w.opts.Markers, w.opts.AllocationID, w.opts.FenceToken, w.opts.Credential = c.Markers(), c.Allocation, c.FenceToken, c.Credential
	w.mu.Unlock()
	w.log.Info("pooled wrapper claimed", "claimed_sandbox", c.SandboxID, "claimed_runtime_key", c.RuntimeKey, "claimed_instance", c.InstanceID)
	return true
}

// endNamespace kills every other process of the wrapper's PID namespace:
// kill(-1) reaches all of them but the namespace's init (bubblewrap, which
// exits with the wrapper) and the caller, whatever group or session they
// moved to. It refuses unless pid 1 is bubblewrap, so a wrapper wrongly
// told it is contained never signals a host's processes.
func endNamespace(log *slog.Logger) {
	comm, err := os.ReadFile("/proc/1/comm")
	if err != nil || strings.TrimSpace(string(comm)) != "bwrap" {
		log.Error("--contained but pid 1 is not bubblewrap; not ending the namespace", "pid1", strings.TrimSpace(string(comm)))
		return
	}
	_ = syscall.Kill(-1, syscall.SIGKILL)
}

// controlAddrs are the addresses to try: the configured ones, then every
// other socket of the control directory (the replicas of this node).
func (w *wrapper) controlAddrs() []string {
	addrs := append([]string{}, w.opts.ControlAddrs...)
	if w.opts.ControlDir == "" {
		return addrs
	}
	socks, _ := socketrelay.Sockets(w.opts.ControlDir)
	for _, s := range socks {
		if a := "unix://" + s; !slices.Contains(addrs, a) {
			addrs = append(addrs, a)
		}
	}
	return addrs
}

// Hello is the Hello of a new control stream, with the routes this
// wrapper serves.
func (w *wrapper) Hello() *sandboxv1.Hello {
	w.mu.Lock()
	defer w.mu.Unlock()
	h := &sandboxv1.Hello{
		SandboxId: w.opts.Markers.SandboxID, AllocationId: w.opts.AllocationID, RuntimeKey: w.opts.Markers.RuntimeKey,
		InstanceId: w.opts.Markers.InstanceID, Generation: w.opts.Markers.Generation, FenceToken: w.opts.FenceToken,
		LaunchCredential: w.opts.Credential, Capabilities: w.opts.Capabilities, ProtocolVersion: ProtocolVersion,
	}
	for id, r := range w.routes {
		if r.ready {
			h.Routes = append(h.Routes, &sandboxv1.ActiveRoute{SessionId: id, RuntimeSessionId: r.runtimeSessionID})
		}
	}
	return h
}

// Heartbeat says whether the runtime runs and which routes are busy.
func (w *wrapper) Heartbeat() *sandboxv1.Heartbeat {
	w.mu.Lock()
	defer w.mu.Unlock()
	hb := &sandboxv1.Heartbeat{Time: timestamppb.Now(), RuntimeRunning: w.runtime != nil}
	for id := range w.busy {
		hb.BusySessionIds = append(hb.BusySessionIds, id)
	}
	return hb
}

// emit queues a frame for the service (kept across reconnects).
func (w *wrapper) emit(f *sandboxv1.ConnectRequest) { w.control.Emit(f) }

// Handle applies one service frame (the stream handles Shutdown).
func (w *wrapper) Handle(msg *sandboxv1.ConnectResponse) {
	switch f := msg.GetFrame().(type) {
	case *sandboxv1.ConnectResponse_PrepareRoute:
		// A clone can take minutes: the stream keeps serving meanwhile.
		go w.prepare(f.PrepareRoute)
	case *sandboxv1.ConnectResponse_WorktreeRequest:
		go w.worktreeRequest(f.WorktreeRequest)
	case *sandboxv1.ConnectResponse_Deliver:
		ctx, span := startFrameSpan(f.Deliver.GetTraceparent(), "wrapper.deliver")
		for _, m := range f.Deliver.GetMessages() {
			w.toRuntime(runtimejsonl.Frame{Type: runtimejsonl.TypeMessage, SessionID: f.Deliver.GetSessionId(), MessageID: m.GetMessageId(), Content: m.GetContent(), Traceparent: traceparentOf(ctx)})
		}
		span.End()
		w.mu.Lock()
		w.busy[f.Deliver.GetSessionId()] = true
		w.mu.Unlock()
	case *sandboxv1.ConnectResponse_Abort:
		w.toRuntime(runtimejsonl.Frame{Type: runtimejsonl.TypeAbort, SessionID: f.Abort.GetSessionId(), MessageID: f.Abort.GetMessageId()})
	case *sandboxv1.ConnectResponse_Credentials:
		w.setHandle(f.Credentials.GetSessionIds(), f.Credentials.GetHandle())
		w.toRuntime(runtimejsonl.Frame{Type: runtimejsonl.TypeCredentials, SessionIDs: f.Credentials.GetSessionIds(), Handle: f.Credentials.GetHandle()})
	case *sandboxv1.ConnectResponse_ReleaseRoute:
		id := f.ReleaseRoute.GetSessionId()
		w.toRuntime(runtimejsonl.Frame{Type: runtimejsonl.TypeCloseRoute, SessionID: id})
		w.mu.Lock()
		delete(w.routes, id)
		delete(w.busy, id)
		w.mu.Unlock()
	}
}

func (w *wrapper) prepare(p *sandboxv1.PrepareRoute) {
	_, span := startFrameSpan(p.GetTraceparent(), "wrapper.prepare_route")
	defer span.End()
	id := p.GetSessionId()
	dir, err := workspaceDir(w.opts.WorkspaceRoot, p.GetDirectory())
	if err != nil {
		w.emit(routeFailed(id, "bad_directory", err.Error(), false))
		return
	}
	w.emit(progress(id, "prepare_worktree", "preparing the worktree directory"))
	if why := w.agentMismatch(p.GetAgent()); why != "" {
		// One agent process per runtime key: the worktree's first session
		// chose it (docs/runtime-protocol.md, "One agent per worktree").
		w.emit(routeFailed(id, "agent_mismatch", why, false))
		return
	}
	w.mu.Lock()
	r := w.routes[id]
	if r == nil {
		r = &routeState{}
		w.routes[id] = r
	}
	r.directory = dir
	r.git = gitRoute{repoURL: p.GetRepoUrl(), clone: p.GetCloneRepo(), ref: p.GetRepoRef(), depth: int(p.GetRepoDepth()), proxyURL: p.GetProxyUrl(), handle: p.GetHandle()}
	w.mu.Unlock()
	if !w.prepareWorktree(id, dir) {
		return
	}
	w.mu.Lock()
	if w.routes[id] != r { // released while the worktree was prepared
		w.mu.Unlock()
		return
	}
	rsid := r.runtimeSessionID
	if rsid == "" {
		// A new route: use the id the sandbox registered with the credential
		// grant, so ingest admits the history the runtime posts under it.
		rsid = p.GetRuntimeSessionId()
	}
	needStart := w.runtime == nil
	w.mu.Unlock()
	if needStart {
		w.emit(progress(id, "start_runtime", "starting the agent runtime"))
		if err := w.startRuntime(); err != nil {
			w.emit(routeFailed(id, "runtime_start_failed", "could not start the runtime", true))
			return
		}
	} else {
		w.emit(progress(id, "reuse_runtime", "joining the running agent runtime"))
	}
	w.toRuntime(runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: id, Directory: dir,
		Handle: p.GetHandle(), ProxyURL: p.GetProxyUrl(), RuntimeSessionID: rsid,
		Agent: p.GetAgent().GetProfile(), RejectToolKinds: p.GetAgent().GetRejectToolKinds()})
}

// agentMismatch says why a route's agent is not the one this wrapper runs:
// another profile, or another model of an ACP profile (the agent's provider
// config names one model). Empty: the same agent.
func (w *wrapper) agentMismatch(a *sandboxv1.Agent) string {
	if p := a.GetProfile(); p != "" && w.opts.Agent != "" && p != w.opts.Agent {
		return fmt.Sprintf("this worktree runs agent %q; the session asks for %q", w.opts.Agent, p)
	}
	if m, run := a.GetModel(), w.opts.RuntimeSpec.Model; m != "" && run != "" && m != run {
		return fmt.Sprintf("this worktree's agent runs model %q; the session asks for %q", run, m)
	}
	return ""
}

// workspaceDir maps a route's absolute directory under the workspace root,
// refusing anything that would escape it.
func workspaceDir(root, dir string) (string, error) {
	if !strings.HasPrefix(dir, "/") || strings.Contains(dir, "\x00") {
		return "", errors.New("directory must be absolute")
	}
	if root == "" {
		// The provider starts the wrapper in the workspace of its directory;
		// every route of a wrapper shares that directory.
		return os.Getwd()
	}
	return filepath.Join(root, filepath.Clean(dir)), nil
}

func (w *wrapper) startRuntime() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.runtime != nil {
		return nil
	}
	if w.stopped {
		return errors.New("the wrapper is stopping")
	}
	var p runtimedriver.Runtime
	p, err := w.opts.Runtime(w.opts.Markers.InstanceID, runtimedriver.Hooks{OnFrame: w.fromRuntime, OnExit: func() { w.runtimeExited(p) }})
	if err != nil {
		return err
	}
	w.runtime = p
	return nil
}

// runtimeExited fails the routes of a runtime that died on its own.
func (w *wrapper) runtimeExited(p runtimedriver.Runtime) {
	w.mu.Lock()
	if w.runtime != p {
		w.mu.Unlock()
		return
	}
	w.runtime = nil
	if w.unclaimed != nil {
		close(w.unclaimed)
		w.unclaimed = nil
	}
	ids := make([]string, 0, len(w.routes))
	for id := range w.routes {
		ids = append(ids, id)
	}
	w.routes = map[string]*routeState{}
	w.busy = map[string]bool{}
	w.mu.Unlock()
	for _, id := range ids {
		w.emit(routeFailed(id, "runtime_exited", "the agent runtime exited", true))
	}
}

func (w *wrapper) stopRuntime() {
	w.mu.Lock()
	p := w.runtime
	w.runtime, w.stopped = nil, true
	w.mu.Unlock()
	if p != nil {
		p.Stop()
	}
}

func (w *wrapper) toRuntime(f runtimejsonl.Frame) {
	w.mu.Lock()
	p := w.runtime
	w.mu.Unlock()
	if p == nil {
		if f.Type == runtimejsonl.TypeOpenRoute {
			w.emit(routeFailed(f.SessionID, "runtime_exited", "the agent runtime is not running", true))
		}
		return
	}
	if err := p.Send(f); err != nil && f.Type == runtimejsonl.TypeMessage {
		w.log.Warn("runtime did not take a message", "session", f.SessionID, "err", err)
	}
}

// fromRuntime turns a runtime frame into a control-stream frame.
func (w *wrapper) fromRuntime(f runtimejsonl.Frame) {
	switch f.Type {
	case runtimejsonl.TypeRouteReady:
		w.mu.Lock()
		if r := w.routes[f.SessionID]; r != nil {
			r.ready, r.runtimeSessionID = true, f.RuntimeSessionID
		}
		w.mu.Unlock()
		w.emit(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_RouteReady{RouteReady: &sandboxv1.RouteReady{SessionId: f.SessionID, RuntimeSessionId: f.RuntimeSessionID}}})
	case runtimejsonl.TypeRouteFailed:
		w.mu.Lock()
		delete(w.routes, f.SessionID)
		w.mu.Unlock()
		w.emit(routeFailed(f.SessionID, f.Reason, f.Detail, f.Retryable))
	case runtimejsonl.TypeProgress:
		w.emit(progress(f.SessionID, f.Step, f.Detail))
	case runtimejsonl.TypeEvent:
		w.emit(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_RuntimeEvents{RuntimeEvents: &sandboxv1.RuntimeEvents{
			SessionId: f.SessionID, Events: EventToProto(f.Event)}}})
	case runtimejsonl.TypeOutcome:
		w.mu.Lock()
		delete(w.busy, f.SessionID)
		w.mu.Unlock()
		w.emit(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Outcome{Outcome: &sandboxv1.TurnOutcome{
			SessionId: f.SessionID, Outcome: OutcomeToProto(f.Outcome)}}})
		if f.Outcome != nil {
			go w.recordChanges(f.SessionID, f.Outcome.TurnID)
		}
	}
}

func progress(id, step, detail string) *sandboxv1.ConnectRequest {
	return &sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Progress{Progress: &sandboxv1.RouteProgress{
		SessionId: id, Progress: progressStep(step, detail)}}}
}

func routeFailed(id, reason, detail string, retryable bool) *sandboxv1.ConnectRequest {
	return &sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_RouteFailed{RouteFailed: &sandboxv1.RouteFailed{
		SessionId: id, Reason: reason, Detail: detail, Retryable: retryable}}}
}

// runtimeStarter picks the runtime driver: ACP for an ACP profile, JSON
// lines (the scripted runtime) otherwise.
// runtimeStarter starts the runtime; behind the boundary its environment
// names the egress proxy (agents.EgressEnv), whatever the profile.
func runtimeStarter(opts Options) runtimedriver.Starter {
	var env []string
	if opts.EgressListen != "" {
		env = agents.EgressEnv("http://"+opts.EgressListen, opts.ProxyListen)
	}
	if opts.RuntimeSpec.Protocol == agents.ProtocolACP {
		spec := opts.RuntimeSpec
		spec.Env = append(slices.Clone(spec.Env), env...)
		cfg := acp.Config{Spec: spec, InitTimeout: opts.AgentInitTimeout, Logger: opts.Logger, Nest: opts.Nest}
		if opts.Claim != nil && opts.WorkspaceRoot == "" {
			// Pooled: the directory the pool serves is where it starts,
			// and the first route's session can be opened before it comes.
			cfg.PrepareSession, _ = os.Getwd()
		}
		return acp.Starter(cfg)
	}
	return jsonl.Starter(opts.RuntimeCommand, opts.Nest, env...)
}
