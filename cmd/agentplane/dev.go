package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"agentplane.dev/client"
	"agentplane.dev/cmd/agentplane/internal/cli"
	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"

	"github.com/alicebob/miniredis/v2"
	"golang.org/x/sync/errgroup"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/config"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/pkg/redistest"
	credential "agentplane.dev/services/credential/server"
	ingest "agentplane.dev/services/ingest/server"
	sandbox "agentplane.dev/services/sandbox/server"
	"agentplane.dev/services/sandbox/wrapper"
	session "agentplane.dev/services/session/server"
)

// devOptions are the flags of `agentplane dev`.
type devOptions struct {
	redisURL          string
	redisURLFile      string
	sandboxRoot       string
	internalToken     string
	internalTokenFile string
	drainDelay        time.Duration
	shutdownTimeout   time.Duration
	logFormat         string
	portBase          int
	// A real agent against an OpenAI-compatible endpoint (see devSession).
	agent, agentsDir, model string
	providerURL, keyFile    string
	worktree                string
	metricsPortBase         int // -1: portBase+2000; 0: no metrics listeners
	sandboxIsolation        string
	redisPort               int  // 0: portBase+5
	fakeModel               bool // serve internal/fakemodel as the provider
	wrapperBin              string
	idleStop                time.Duration // 0: the sandbox service's setting
	// pool is the warm pool: auto (2 per installed profile), off, or
	// SANDBOX_POOL's profile=N,...; poolDir the directory it serves.
	pool, poolDir string
}

// devPorts lays the services out from base: gRPC on base..base+3 (session,
// sandbox, credential, ingest), the credential proxy on base+4, metrics on
// metricsBase..metricsBase+3 (no metrics listeners when metricsBase is 0).
// The default base 7401 gives docs/development.md's ports; another base
// lets a second suite (or a test) run beside it.
func devPorts(base, metricsBase int, ses, sbx, cred, ing *config.Common, proxy *string) {
	for i, c := range []*config.Common{ses, sbx, cred, ing} {
		c.GRPCAddr = fmt.Sprintf("127.0.0.1:%d", base+i)
		c.MetricsAddr = ""
		if metricsBase > 0 {
			c.MetricsAddr = fmt.Sprintf("127.0.0.1:%d", metricsBase+i)
		}
	}
	*proxy = fmt.Sprintf("127.0.0.1:%d", base+4)
}

// checkPorts validates --port-base and --metrics-port-base and resolves
// the metrics default (port base + 2000).
func (o *devOptions) checkPorts() error {
	if o.portBase < 1 || o.portBase+6 > 65535 {
		return fmt.Errorf("--port-base %d: the ports base..base+6 must lie in 1..65535", o.portBase)
	}
	if o.redisPort == 0 {
		o.redisPort = o.portBase + 5
	}
	if o.redisPort < 1 || o.redisPort > 65535 {
		return fmt.Errorf("--redis-port %d: must lie in 1..65535", o.redisPort)
	}
	if o.metricsPortBase == -1 {
		o.metricsPortBase = o.portBase + 2000
	}
	if o.metricsPortBase != 0 && (o.metricsPortBase < 1 || o.metricsPortBase+3 > 65535) {
		return fmt.Errorf("--metrics-port-base %d: the ports base..base+3 must lie in 1..65535 (0: no metrics)", o.metricsPortBase)
	}
	if m := o.metricsPortBase; m != 0 && m+3 >= o.portBase && m <= o.portBase+6 {
		return fmt.Errorf("--metrics-port-base %d overlaps the service ports %d..%d", m, o.portBase, o.portBase+6)
	}
	return nil
}

// metricsColumn is a service's metrics address for the start-up table.
func metricsColumn(addr string) string {
	if addr == "" {
		return "off"
	}
	return "http://" + addr + "/metrics"
}

// runDev runs all four services in this process on the fixed local ports of
// docs/development.md, against --redis or a private redis-server it starts
// and stops itself.
func runDev(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseDev(args)
	if err != nil {
		return err
	}
	return o.run(ctx, stdout, stderr)
}

// parseDev parses dev's flags (the flag package prints on os.Stderr).
func parseDev(args []string) (devOptions, error) {
	var o devOptions
	fs := flag.NewFlagSet("agentplane dev", flag.ContinueOnError)
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL to use; empty starts a private redis-server (or, where none is installed, an in-memory Redis)")
	fs.IntVar(&o.redisPort, "redis-port", 0, "port of the private redis-server; 0: port base + 5")
	fs.StringVar(&o.sandboxRoot, "sandbox-root", "", "directory of the process provider's sandboxes; empty: a new temporary directory")
	fs.StringVar(&o.redisURLFile, "redis-file", "", "file holding the Redis URL (when it carries a password)")
	fs.StringVar(&o.internalToken, "internal-token", "", "service-to-service bearer token (prefer --internal-token-file); empty: a new random one, which the CLI reads from dev's state file")
	fs.StringVar(&o.internalTokenFile, "internal-token-file", "", "file holding the service-to-service bearer token")
	fs.DurationVar(&o.drainDelay, "drain-delay", envDuration("AGENTPLANE_DRAIN_DELAY", 500*time.Millisecond), "time between NOT_SERVING and stopping on SIGTERM (env AGENTPLANE_DRAIN_DELAY)")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", envDuration("AGENTPLANE_SHUTDOWN_TIMEOUT", 5*time.Second), "bound on the graceful stop of each service (env AGENTPLANE_SHUTDOWN_TIMEOUT)")
	fs.StringVar(&o.logFormat, "log-format", envOr("AGENTPLANE_LOG_FORMAT", "text"), "json or text (env AGENTPLANE_LOG_FORMAT)")
	fs.StringVar(&o.sandboxIsolation, "sandbox-isolation", os.Getenv("AGENTPLANE_SANDBOX_ISOLATION"), "namespaces or none (env AGENTPLANE_SANDBOX_ISOLATION); empty: namespaces when this host allows them, else none with a warning")
	fs.StringVar(&o.wrapperBin, "wrapper-bin", os.Getenv("AGENTPLANE_WRAPPER_BIN"), "the wrapper binary sandboxes start (env AGENTPLANE_WRAPPER_BIN); empty: agentplane-wrapper next to this binary or on PATH, else built from this checkout, as the image ships it")
	fs.DurationVar(&o.idleStop, "idle-stop", 0, "stop a sandbox's wrapper after this long without activity (AGENTPLANE_SANDBOX_IDLE_STOP); 0: the sandbox service's setting")
	fs.StringVar(&o.pool, "pool", envOr("AGENTPLANE_SANDBOX_POOL", "auto"), "warm pool (env AGENTPLANE_SANDBOX_POOL): auto (2 sandboxes per installed agent profile), off, or profile=N,...")
	fs.StringVar(&o.poolDir, "pool-directory", "", "the session directory the pool serves; empty: the directory dev runs in (where `agentplane run` takes its --dir from)")
	fs.IntVar(&o.portBase, "port-base", 7401, "first of the five service ports; 7401 gives the documented ports")
	fs.IntVar(&o.metricsPortBase, "metrics-port-base", -1, "first of the four /metrics ports (session, sandbox, credential, ingest); -1: port base + 2000; 0: no metrics")
	fs.StringVar(&o.agent, "agent", os.Getenv("AGENTPLANE_AGENT_DEFAULT"), "agent profile of sessions that name none (scripted, opencode, kilo); with --provider-key-file dev creates a session that runs it")
	fs.StringVar(&o.agentsDir, "agents-dir", os.Getenv("AGENTPLANE_AGENTS_DIR"), "directory of the pinned agents (make agents installs into agents/); empty: ./agents when it exists")
	fs.StringVar(&o.model, "model", envOr("AGENTPLANE_AGENT_MODEL", "default"), "model the ACP agents ask the provider for (env AGENTPLANE_AGENT_MODEL)")
	fs.BoolVar(&o.fakeModel, "fake-model", true, "without --provider-url: serve the project's fake OpenAI-compatible model on port base + 6 as the provider, so the agents run offline (false: no provider)")
	fs.StringVar(&o.providerURL, "provider-url", os.Getenv("AGENTPLANE_PROVIDER_UPSTREAM"), "(env AGENTPLANE_PROVIDER_UPSTREAM) base URL of an OpenAI-compatible provider behind the proxy's provider/ route; the agent's requests go to <url>/v1/chat/completions")
	fs.StringVar(&o.keyFile, "provider-key-file", "", "file holding the provider API key; dev creates a session with it as the static credential (the key goes only to the credential service)")
	fs.StringVar(&o.worktree, "worktree", "/work/dev-agent", "worktree directory of the session dev creates")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if o.providerURL != "" {
		o.fakeModel = false
	}
	return o, nil
}

// envOr is the environment variable name, or def when it is unset or empty.
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// envDuration is the environment variable name as a duration, or def when
// it is unset or not a duration (the service's own loader reports that).
func envDuration(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(name)); err == nil {
		return d
	}
	return def
}

func (o devOptions) run(ctx context.Context, stdout, stderr io.Writer) error {
	if o.agentsDir == "" {
		if st, err := os.Stat("agents"); err == nil && st.IsDir() {
			o.agentsDir, _ = filepath.Abs("agents")
		}
	}
	var providerKey string
	if o.keyFile != "" {
		b, err := os.ReadFile(o.keyFile)
		if err != nil {
			return fmt.Errorf("--provider-key-file: %w", err)
		}
		if providerKey = strings.TrimSpace(string(b)); providerKey == "" {
			return errors.New("--provider-key-file: the file is empty")
		}
	}
	if err := o.checkPorts(); err != nil {
		return err
	}
	if err := o.readSecretFiles(stderr); err != nil {
		return err
	}
	// The services' calls to each other (SessionNotifyService among them)
	// need the token like every other call, so dev always has one.
	if o.internalToken == "" {
		token, err := randomToken()
		if err != nil {
			return err
		}
		o.internalToken = token
	}

	scratch, err := os.MkdirTemp("", "agentplane-dev-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(scratch)
	// Sandboxes run as their own user: it must be able to traverse to the
	// sandbox root (not list the scratch directory).
	if err := os.Chmod(scratch, 0o711); err != nil {
		return err
	}
	if o.sandboxRoot == "" {
		o.sandboxRoot = filepath.Join(scratch, "sandboxes")
	}

	redisURL, redisWhat, stopRedis, err := devRedis(o.redisURL, o.redisPort, filepath.Join(scratch, "redis"), stderr)
	if err != nil {
		return err
	}
	// Redis stops last, after every service and sandbox process: they use
	// it up to their last act.
	defer stopRedis()

	self, err := os.Executable()
	if err != nil {
		return err
	}
	ses, sbx, cred, ing, err := devConfigs(redisURL)
	if err != nil {
		return err
	}
	common := func(c *config.Common) {
		c.RedisURL = redisURL
		c.InternalToken = o.internalToken
		c.DrainDelay = o.drainDelay
		c.ShutdownTimeout = o.shutdownTimeout
		c.LogFormat = o.logFormat
	}
	common(&ses.Common)
	common(&sbx.Common)
	common(&cred.Common)
	common(&ing.Common)
	devPorts(o.portBase, o.metricsPortBase, &ses.Common, &sbx.Common, &cred.Common, &ing.Common, &cred.ProxyAddr)
	ses.SandboxAddr, ses.CredentialAddr, ses.IngestAddr = sbx.GRPCAddr, cred.GRPCAddr, ing.GRPCAddr
	sbx.SessionAddr, sbx.CredentialAddr = ses.GRPCAddr, cred.GRPCAddr
	sbx.ProxyURL = "http://" + cred.ProxyAddr
	sbx.SandboxRoot = o.sandboxRoot
	if sbx.WrapperBin, err = devWrapper(o.wrapperBin, self, filepath.Join(scratch, "build"), stderr); err != nil {
		return err
	}
	if o.idleStop > 0 {
		sbx.Timers.IdleStop = o.idleStop
	}
	cred.IngestAddr, cred.SessionAddr = ing.GRPCAddr, ses.GRPCAddr
	ing.CredentialAddr = cred.GRPCAddr
	sbx.AgentsDir, sbx.AgentModel = o.agentsDir, o.model
	if o.agent != "" {
		sbx.AgentDefault = o.agent
	}
	providerWhat := "none (--provider-url gives one)"
	if o.providerURL != "" {
		cred.ProviderUpstream = o.providerURL
		providerWhat = o.providerURL
	}
	if o.fakeModel {
		stopModel, url, err := startFakeModel(fmt.Sprintf("127.0.0.1:%d", o.portBase+6))
		if err != nil {
			return err
		}
		defer stopModel()
		cred.ProviderUpstream = url
		providerWhat = "the fake model at " + url + " (offline; --provider-url gives a real one)"
	}
	if sbx.Pool, sbx.PoolDirectory, err = devPool(o.pool, o.poolDir, &sbx); err != nil {
		return err
	}
	for _, v := range []interface{ Validate() error }{&ses, &sbx, &cred, &ing} {
		if err := v.Validate(); err != nil {
			return err
		}
	}
	isolation := devIsolation(&sbx, o.sandboxIsolation, scratch)
	if sbx.Isolation == "none" {
		fmt.Fprintf(stderr, "agentplane dev: WARNING: %s\n", isolation)
	}

	credWhat, err := devHandOver(ses.GRPCAddr, providerKey, ses.InternalToken)
	if err != nil {
		return err
	}
	tokenFile := filepath.Join(scratch, "internal-token")
	if err := os.WriteFile(tokenFile, []byte(o.internalToken), 0o600); err != nil {
		return err
	}
	defer func() { _ = os.Remove(cli.DevStatePath(portOf(ses.GRPCAddr))) }()

	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "agentplane dev (pid %d): Redis %s\n", os.Getpid(), redisWhat)
	fmt.Fprintf(tw, "provider: %s\n", providerWhat)
	fmt.Fprintf(tw, "credential: %s\n", credWhat)
	fmt.Fprintf(tw, "wrapper: %s\n", sbx.WrapperBin)
	fmt.Fprintf(tw, "internal token: in %s (every call needs it; the CLI reads it itself)\n", tokenFile)

	fmt.Fprintln(tw, "SERVICE\tgRPC\tMETRICS\tNOTES")
	fmt.Fprintf(tw, "session\t%s\t%s\tpublic agentplane.session.v1.SessionService\n", ses.GRPCAddr, metricsColumn(ses.MetricsAddr))
	fmt.Fprintf(tw, "sandbox\t%s\t%s\tprocess provider, sandboxes in %s\n", sbx.GRPCAddr, metricsColumn(sbx.MetricsAddr), sbx.SandboxRoot)
	fmt.Fprintf(tw, "\t\t\t%s\n", isolation)
	if sbx.Pool != "" {
		fmt.Fprintf(tw, "\t\t\twarm pool %s for sessions at %s (--pool off: none)\n", sbx.Pool, sbx.PoolDirectory)
	}
	if ok, why := sandbox.CgroupLimits(); !ok {
		fmt.Fprintf(tw, "\t\t\tcgroup limits unavailable: %s\n", why)
	}
	fmt.Fprintf(tw, "credential\t%s\t%s\tHTTP credential proxy on %s\n", cred.GRPCAddr, metricsColumn(cred.MetricsAddr), cred.ProxyAddr)
	fmt.Fprintf(tw, "ingest\t%s\t%s\t\n", ing.GRPCAddr, metricsColumn(ing.MetricsAddr))
	_ = tw.Flush()
	fmt.Fprintf(stdout, "try: %sagentplane run \"hello\" (agentplane session -h lists the other verbs; grpcurl -plaintext -H \"authorization: Bearer $(cat %s)\" %s list the API)\n",
		addrPrefix(ses.GRPCAddr), tokenFile, ses.GRPCAddr)

	g, gctx := errgroup.WithContext(ctx)
	// The sandbox service stops first and the others once it has: up to its
	// last act it sends notifications (turn outcomes) to the session service
	// and calls the credential service.
	peersCtx, stopPeers := context.WithCancel(context.WithoutCancel(gctx))
	defer stopPeers()
	// The session service's drains stop at once (they call the sandbox
	// service, which is stopping); it goes on serving its notifications.
	ses.StopLoops = gctx.Done()
	g.Go(func() error { defer stopPeers(); return named("sandbox", sandbox.Run(gctx, sbx)) })
	g.Go(func() error { return named("session", session.Run(peersCtx, ses)) })
	g.Go(func() error { return named("credential", credential.Run(peersCtx, cred)) })
	g.Go(func() error { return named("ingest", ingest.Run(peersCtx, ing)) })
	if providerKey != "" {
		g.Go(func() error { return devSession(gctx, ses.GRPCAddr, o, providerKey, stdout) })
	}
	err = g.Wait()
	// The wrappers would wait out their reconnect window; dev owns the
	// sandbox root and deletes it, so it stops what still runs there.
	if left := sandboxprocs.Stop(o.sandboxRoot, 2*time.Second, 10*time.Second); len(left) > 0 {
		fmt.Fprintf(stderr, "agentplane dev: processes still running under %s: %v\n", o.sandboxRoot, left)
	}
	fmt.Fprintln(stdout, "agentplane dev: stopped")
	return err
}

// readSecretFiles reads the secret flags' file forms (config.ReadSecretFile's rules) and
// warns about a secret given on the command line, which every local user can read.
func (o *devOptions) readSecretFiles(stderr io.Writer) error {
	for _, s := range []struct {
		flag       string
		value      *string
		file       string
		secretWhen func(string) bool
	}{
		{"redis", &o.redisURL, o.redisURLFile, func(u string) bool { return redact(u) != u }},
		{"internal-token", &o.internalToken, o.internalTokenFile, func(string) bool { return true }},
	} {
		switch {
		case s.file != "" && *s.value != "":
			return fmt.Errorf("give either --%s or --%s-file, not both", s.flag, s.flag)
		case s.file != "":
			v, err := config.ReadSecretFile(s.file)
			if err != nil {
				return fmt.Errorf("--%s-file: %w", s.flag, err)
			}
			*s.value = v
		case *s.value != "" && s.secretWhen(*s.value):
			fmt.Fprintf(stderr, "WARNING: --%s is on the command line, which every process on the host can read; pass --%s-file instead\n", s.flag, s.flag)
		}
	}
	return nil
}

// redact hides the credentials of a URL (a Redis URL may carry a password).
func redact(rawURL string) string {
	scheme, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return rawURL
	}
	authority, tail := rest, ""
	if i := strings.IndexAny(rest, "/?"); i >= 0 {
		authority, tail = rest[:i], rest[i:]
	}
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		return scheme + "://xxxxx@" + authority[i+1:] + tail
	}
	return rawURL
}

func named(service string, err error) error {
	if err != nil {
		return fmt.Errorf("%s: %w", service, err)
	}
	return nil
}

// devRedis returns the Redis URL to use and a function that stops whatever
// was started for it.
func devRedis(url string, port int, dir string, stderr io.Writer) (string, string, func(), error) {
	if url != "" {
		return url, redact(url), func() {}, nil
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	// A port already taken would be answered by whatever holds it.
	if l, err := net.Listen("tcp", addr); err != nil {
		return "", "", nil, fmt.Errorf("--redis-port %d: %w", port, err)
	} else {
		_ = l.Close()
	}
	if _, err := exec.LookPath(redistest.Binary); err == nil {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return "", "", nil, err
		}
		// Its own process group: a terminal's Ctrl-C reaches dev, which
		// stops it last, not the server directly.
		srv, err := redistest.New(dir, redistest.WithPort(port), redistest.WithOwnProcessGroup())
		if err != nil {
			return "", "", nil, fmt.Errorf("start private redis-server: %w", err)
		}
		return srv.URL(), fmt.Sprintf("private redis-server at %s (stopped on exit)", srv.URL()), func() { _ = srv.Close() }, nil
	}
	fmt.Fprintln(stderr, "WARNING: redis-server is not installed; using an embedded in-memory Redis (dev only: no persistence, partial Lua and stream support). Install redis-server or pass --redis.")
	mr := miniredis.NewMiniRedis()
	if err := mr.StartAddr(addr); err != nil {
		return "", "", nil, errors.Join(errors.New("start embedded Redis"), err)
	}
	u := "redis://" + mr.Addr()
	return u, "embedded in-memory Redis at " + u, mr.Close, nil
}

// devSession creates the session `--provider-key-file` asks for, once the
// session service answers, and prints how to talk to it. The key travels
// only in CreateSession's credential (to the credential service); it is
// never printed or logged.
func devSession(ctx context.Context, addr string, o devOptions, key string, stdout io.Writer) error {
	conn, err := grpcclient.Dial(addr, o.internalToken)
	if err != nil {
		return err
	}
	defer conn.Close()
	c := sessionv1.NewSessionServiceClient(conn)
	req := &sessionv1.CreateSessionRequest{
		UserId: "dev", OrgId: "dev", Worktree: &sessionv1.Worktree{Directory: o.worktree},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: key},
		Agent:      &sessionv1.Agent{Profile: o.agent},
	}
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := c.CreateSession(ctx, req)
		if err == nil {
			id := resp.GetSession().GetSessionId()
			fmt.Fprintf(stdout, "agentplane dev: session %s runs agent %s in %s\n", id, resp.GetSession().GetAgent().GetProfile(), o.worktree)
			fmt.Fprintf(stdout, "  %sagentplane session send %s \"create hello.txt\"\n", addrPrefix(addr), id)
			fmt.Fprintf(stdout, "  %sagentplane session watch %s\n", addrPrefix(addr), id)
			return nil
		}
		if reason := apierr.Reason(err); reason == "AGENT_UNAVAILABLE" || reason == "INVALID_REQUEST" {
			return fmt.Errorf("dev session: %w", err)
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("dev session: the session service did not answer: %w", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// reachableCopy copies the executable bin into dir (created 0755) as a
// file everyone may read and run, for a sandbox user to start.
func reachableCopy(bin, dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	src, err := os.Open(bin)
	if err != nil {
		return "", err
	}
	defer src.Close()
	dst := filepath.Join(dir, filepath.Base(bin))
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return "", err
	}
	_, cerr := io.Copy(f, src)
	if err := errors.Join(cerr, f.Close()); err != nil {
		return "", err
	}
	return dst, nil
}

// devIsolation picks the sandbox boundary for dev: what was asked, or by
// default namespaces when this host allows them (probed once, as the
// sandbox service itself would at start), falling back to the service's own
// uid when the unprivileged sandbox user cannot reach the wrapper binary (nor a
// copy of it under scratch) or the sandbox root, and to none, with the reason,
// when the kernel refuses.
// It returns the line for the start-up table.
func devIsolation(sbx *sandbox.Config, want, scratch string) string {
	if want == "none" {
		sbx.Isolation = "none"
		return "isolation: NONE (--sandbox-isolation=none): runtimes share the services' user, PID and network namespace"
	}
	ctx := context.Background()
	uid, err := sandbox.ProbeIsolation(ctx, *sbx)
	if err != nil && uid != "" {
		// `go run` and `go test` build into a directory only this user can
		// enter: a copy the sandbox user can reach keeps the sandboxes off
		// this process's uid.
		if bin, cerr := reachableCopy(sbx.WrapperBin, filepath.Join(scratch, "bin")); cerr == nil {
			try := *sbx
			try.WrapperBin = bin
			if u, perr := sandbox.ProbeIsolation(ctx, try); perr == nil {
				sbx.WrapperBin, uid, err = bin, u, nil
			}
		}
	}
	if err != nil && uid != "" {
		first := err
		sbx.SandboxUID = -1
		if uid, err = sandbox.ProbeIsolation(ctx, *sbx); err == nil {
			return fmt.Sprintf("isolation: namespaces (bubblewrap), sandboxes as this process's uid: as nobody: %v", first)
		}
	}
	if err != nil {
		if want == "namespaces" {
			return "isolation: namespaces requested but unavailable: " + err.Error()
		}
		sbx.Isolation = "none"
		return "isolation: NONE, sandboxes run without a boundary: " + err.Error()
	}
	if uid == "" {
		uid = "this process's"
	}
	return "isolation: namespaces (bubblewrap), sandboxes as uid " + uid
}

// devConfigs loads the four services' configurations from the environment,
// so every AGENTPLANE_* setting dev does not set itself (addresses, ports,
// Redis, the sandbox root, the peers) applies as it would to the service.
func devConfigs(redisURL string) (session.Config, sandbox.Config, credential.Config, ingest.Config, error) {
	lookup := func(k string) (string, bool) {
		switch k {
		case "AGENTPLANE_REDIS_URL":
			return redisURL, true
		case "AGENTPLANE_REDIS_URL_FILE":
			return "", false
		}
		return os.LookupEnv(k)
	}
	ses, err1 := session.LoadConfig(nil, lookup)
	sbx, err2 := sandbox.LoadConfig(nil, lookup)
	cred, err3 := credential.LoadConfig(nil, lookup)
	ing, err4 := ingest.LoadConfig(nil, lookup)
	return ses, sbx, cred, ing, errors.Join(err1, err2, err3, err4)
}

// devWrapper picks the wrapper binary: the one asked for, else
// agentplane-wrapper next to this binary or on PATH (the image's), else one
// built from this checkout into dir; this binary's own `wrapper` only when
// none can be had (it starts slower: it links all four services).
func devWrapper(asked, self, dir string, stderr io.Writer) (string, error) {
	if asked != "" {
		return filepath.Abs(asked)
	}
	const name = "agentplane-wrapper"
	if p := filepath.Join(filepath.Dir(self), name); isExecutable(p) {
		return p, nil
	}
	if p, err := exec.LookPath(name); err == nil {
		return filepath.Abs(p)
	}
	out := filepath.Join(dir, name)
	build := exec.Command("go", slices.Concat([]string{"build"}, wrapper.BuildFlags, []string{"-o", out, "agentplane.dev/services/sandbox/cmd/agentplane-wrapper"})...)
	if msg, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(stderr, "agentplane dev: WARNING: cannot build %s (%v: %s); sandboxes start this binary's wrapper, which starts slower\n",
			name, err, strings.TrimSpace(string(msg)))
		return self, nil
	}
	return out, nil
}

func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// startFakeModel serves internal/fakemodel on addr.
func startFakeModel(addr string) (stop func(), url string, err error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("fake model on %s: %w", addr, err)
	}
	srv := &http.Server{Handler: fakemodel.New(), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	return func() { _ = srv.Close() }, "http://" + addr, nil
}

// randomToken is a new internal token: 32 random bytes, hex.
func randomToken() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// devHandOver writes the state file `agentplane run` reads (the provider key
// and the internal token, when dev has them) and says which credential run
// will use.
func devHandOver(sessionAddr, providerKey, internalToken string) (string, error) {
	path, err := cli.WriteDevState(portOf(sessionAddr), cli.DevState{PID: os.Getpid(), Credential: providerKey, InternalToken: internalToken})
	if err != nil {
		return "", fmt.Errorf("dev state file: %w", err)
	}
	if providerKey != "" {
		return "`agentplane run` and `session create` use the key of --provider-key-file (handed over in " + path + ", mode 0600; AGENTPLANE_CREDENTIAL overrides it)", nil
	}
	return "`agentplane run` and `session create` use a placeholder key (--provider-key-file or AGENTPLANE_CREDENTIAL gives a real one)", nil
}

func portOf(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	return port
}

// addrPrefix is what a command of the CLI needs to reach dev's session
// service at addr: nothing on the default address, else AGENTPLANE_ADDR.
func addrPrefix(addr string) string {
	if addr == client.DefaultAddr {
		return ""
	}
	return "AGENTPLANE_ADDR=" + addr + " "
}

// devPool resolves dev's --pool and --pool-directory: auto is 2 sandboxes
// of every profile this configuration has installed, off is none; the
// directory defaults to dev's own (the CLI's default --dir).
func devPool(pool, dir string, sbx *sandbox.Config) (string, string, error) {
	if dir == "" {
		wd, err := os.Getwd()
		if err != nil {
			return "", "", err
		}
		dir = wd
	}
	switch pool {
	case "off":
		return "", dir, nil
	case "auto":
		reg := sbx.Agents()
		var sizes []string
		for _, name := range reg.Names() {
			if _, err := reg.Resolve(name, ""); err == nil {
				sizes = append(sizes, name+"=2")
			}
		}
		return strings.Join(sizes, ","), dir, nil
	}
	return pool, dir, nil
}
