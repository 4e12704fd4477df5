package server_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testenv"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/server"
)

var (
	redisSrv *redistest.Server
	binPath  string // the sandbox binary: service, `wrapper` and `runtime scripted`
)

func TestMain(m *testing.M) {
	code := runMain(m)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func runMain(m *testing.M) int {
	{
		srv, stop := redistest.StartMain()
		defer stop()
		redisSrv = srv
		dir, err := os.MkdirTemp("", "sandbox-bin")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		// Sandboxes run as their own user: the wrapper binary must be reachable.
		if err := os.Chmod(dir, 0o755); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		binPath = filepath.Join(dir, "sandbox")
		build := exec.Command("go", "build", "-o", binPath, "agentplane.dev/services/sandbox/cmd/sandbox")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "build sandbox binary:", err)
			return 1
		}
		return m.Run()
	}
}

// note is one notification the fake session service received.
type note struct {
	Kind, Session, Sandbox, Instance, Reason, RuntimeSessionID string
	FenceToken                                                 uint64
	Text                                                       string
}

// fakeNotify is a real SessionNotifyService gRPC server recording calls.
type fakeNotify struct {
	sessionv1.UnimplementedSessionNotifyServiceServer
	test  string // the test it serves; see sandboxTest
	mu    sync.Mutex
	notes []note
	addr  string
	// refuse makes every call fail with Unavailable (the session service
	// is down), refuseOutcomes only turn outcomes; refused counts the calls
	// refused.
	refuse, refuseOutcomes atomic.Bool
	refused                atomic.Int64
	// refusedOutcomes counts the turn outcomes among them.
	refusedOutcomes atomic.Int64
}

func (f *fakeNotify) gate(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	outcome := strings.HasSuffix(info.FullMethod, "/NotifyTurnOutcome")
	if f.refuse.Load() || f.refuseOutcomes.Load() && outcome {
		f.refused.Add(1)
		if outcome {
			f.refusedOutcomes.Add(1)
		}
		return nil, status.Error(codes.Unavailable, "session service down (test)")
	}
	return h(ctx, req)
}

// sandboxTest maps each sandbox id uniqueSandbox made to its test. All
// tests share one Redis, and a service takes over the sandboxes that
// earlier tests' services left behind, notifying its own test's sink about
// them (every test names its session "s1"); a sink records only its own
// test's sandboxes.
var sandboxTest sync.Map // sandbox id -> test name

func startNotify(t *testing.T) *fakeNotify {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f := &fakeNotify{addr: lis.Addr().String(), test: t.Name()}
	g := grpc.NewServer(grpc.UnaryInterceptor(f.gate))
	sessionv1.RegisterSessionNotifyServiceServer(g, f)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	return f
}

func (f *fakeNotify) add(n note) {
	if owner, ok := sandboxTest.Load(n.Sandbox); ok && owner != f.test {
		return
	}
	f.mu.Lock()
	f.notes = append(f.notes, n)
	f.mu.Unlock()
}

func (f *fakeNotify) all() []note {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]note(nil), f.notes...)
}

// find returns the first note after index from matching kind and session.
func (f *fakeNotify) find(from int, kind, session string) (note, int, bool) {
	all := f.all()
	for i := from; i < len(all); i++ {
		if all[i].Kind == kind && all[i].Session == session {
			return all[i], i, true
		}
	}
	return note{}, -1, false
}

// wait polls for a note of kind for session after index from.
func (f *fakeNotify) wait(t *testing.T, from int, kind, session string) (note, int) {
	t.Helper()
	var n note
	var idx int
	require.Eventually(t, func() bool {
		var ok bool
		n, idx, ok = f.find(from, kind, session)
		return ok
	}, 60*time.Second, 20*time.Millisecond, "no %s notification for %s; got %+v", kind, session, f.all())
	return n, idx
}

func (f *fakeNotify) NotifyRouteProgress(_ context.Context, r *sessionv1.NotifyRouteProgressRequest) (*sessionv1.NotifyRouteProgressResponse, error) {
	f.add(note{Kind: "progress", Session: r.GetRoute().GetSessionId(), Sandbox: r.GetRoute().GetSandboxId(), Text: r.GetProgress().GetStep(), FenceToken: r.GetRoute().GetFenceToken()})
	return &sessionv1.NotifyRouteProgressResponse{}, nil
}

func (f *fakeNotify) NotifyRouteReady(_ context.Context, r *sessionv1.NotifyRouteReadyRequest) (*sessionv1.NotifyRouteReadyResponse, error) {
	f.add(note{Kind: "ready", Session: r.GetRoute().GetSessionId(), Sandbox: r.GetRoute().GetSandboxId(), Instance: r.GetWrapperInstance(), RuntimeSessionID: r.GetRuntimeSessionId(), FenceToken: r.GetRoute().GetFenceToken()})
	return &sessionv1.NotifyRouteReadyResponse{}, nil
}

func (f *fakeNotify) NotifyRouteReconnecting(_ context.Context, r *sessionv1.NotifyRouteReconnectingRequest) (*sessionv1.NotifyRouteReconnectingResponse, error) {
	f.add(note{Kind: "reconnecting", Session: r.GetRoute().GetSessionId(), Sandbox: r.GetRoute().GetSandboxId(), FenceToken: r.GetRoute().GetFenceToken()})
	return &sessionv1.NotifyRouteReconnectingResponse{}, nil
}

func (f *fakeNotify) NotifyRouteFailed(_ context.Context, r *sessionv1.NotifyRouteFailedRequest) (*sessionv1.NotifyRouteFailedResponse, error) {
	f.add(note{Kind: "failed", Session: r.GetRoute().GetSessionId(), Sandbox: r.GetRoute().GetSandboxId(), Reason: r.GetReason()})
	return &sessionv1.NotifyRouteFailedResponse{}, nil
}

func (f *fakeNotify) NotifyRouteLost(_ context.Context, r *sessionv1.NotifyRouteLostRequest) (*sessionv1.NotifyRouteLostResponse, error) {
	f.add(note{Kind: "lost", Session: r.GetRoute().GetSessionId(), Sandbox: r.GetRoute().GetSandboxId(), Reason: r.GetReason()})
	return &sessionv1.NotifyRouteLostResponse{}, nil
}

func (f *fakeNotify) NotifyRuntimeEvents(_ context.Context, r *sessionv1.NotifyRuntimeEventsRequest) (*sessionv1.NotifyRuntimeEventsResponse, error) {
	for _, e := range r.GetEvents() {
		f.add(note{Kind: "event:" + e.GetKind().String(), Session: r.GetRoute().GetSessionId(), Sandbox: r.GetRoute().GetSandboxId(), Text: e.GetText()})
	}
	return &sessionv1.NotifyRuntimeEventsResponse{}, nil
}

func (f *fakeNotify) NotifyTurnOutcome(_ context.Context, r *sessionv1.NotifyTurnOutcomeRequest) (*sessionv1.NotifyTurnOutcomeResponse, error) {
	f.add(note{Kind: "outcome", Session: r.GetRoute().GetSessionId(), Sandbox: r.GetRoute().GetSandboxId(), Reason: r.GetOutcome().GetResult().String(), Text: r.GetOutcome().GetLastMessageId()})
	return &sessionv1.NotifyTurnOutcomeResponse{}, nil
}

// testTimers are short so the tests run in seconds.
func testTimers() allocation.Timers {
	return allocation.Timers{
		Create: 20 * time.Second, FirstHello: 30 * time.Second, Heartbeat: 200 * time.Millisecond,
		DeadAfter: 1500 * time.Millisecond, ReconnectWindow: 4 * time.Second, IdleStop: 10 * time.Minute,
	}
}

// service is one in-process sandbox service.
type service struct {
	addr   string
	root   string
	client sandboxv1.SandboxServiceClient
}

func startService(t *testing.T, notifyAddr string, mutate func(*server.Config)) *service {
	t.Helper()
	return startServiceCtx(t, context.Background(), notifyAddr, mutate, nil)
}

func startServiceCtx(t *testing.T, parent context.Context, notifyAddr string, mutate func(*server.Config), stopped chan struct{}) *service {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	cfg := server.DefaultConfig()
	cfg.RedisURL = redisSrv.URL()
	cfg.MetricsAddr = ""
	cfg.DrainDelay = 0
	cfg.ShutdownTimeout = 2 * time.Second
	cfg.SandboxRoot = testenv.SandboxRoot(t)
	cfg.WrapperCommand = []string{binPath, "wrapper"}
	cfg.SessionAddr = notifyAddr
	cfg.ProxyURL = ""
	cfg.ReplicaID = "r-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	cfg.OwnerTTL = 2 * time.Second
	cfg.Timers = testTimers()
	if mutate != nil {
		mutate(&cfg)
	}
	require.NoError(t, cfg.Validate())
	ctx, cancel := context.WithCancel(parent)
	done := make(chan error, 1)
	go func() {
		done <- server.RunWith(ctx, cfg, server.Listeners{GRPC: lis})
		if stopped != nil {
			close(stopped)
		}
	}()
	var once sync.Once
	var runErr error
	wait := func() { once.Do(func() { runErr = <-done }) }
	if stopped != nil {
		go wait()
	}
	t.Cleanup(func() {
		cancel()
		wait()
		require.NoError(t, runErr)
	})
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return &service{addr: lis.Addr().String(), root: cfg.SandboxRoot, client: sandboxv1.NewSandboxServiceClient(conn)}
}

// logWrappers prints the wrapper logs under root when the test failed.
func logWrappers(t *testing.T, root string) {
	if !t.Failed() {
		return
	}
	logs, _ := filepath.Glob(filepath.Join(root, "*", "logs", "*.log"))
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		t.Logf("wrapper log %s:\n%s", l, b)
	}
}

func uniqueSandbox(t *testing.T) string {
	sb := "sb-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	sandboxTest.Store(sb, t.Name())
	t.Cleanup(func() { killSandbox(sb) })
	return sb
}

func route(sandbox, session, dir string) *sandboxv1.PrepareRequest {
	return &sandboxv1.PrepareRequest{Route: &sandboxv1.RouteSpec{
		SessionId: session, SandboxId: sandbox, Directory: dir, UserId: "u1", OrgId: "o1",
		CredentialRef: "ref-" + session, CredentialClass: sandboxv1.CredentialClass_CREDENTIAL_CLASS_STATIC,
	}}
}

// testTenant is the tenant of every route the tests prepare (route).
var testTenant = &sandboxv1.Tenant{OrgId: "o1", UserId: "u1"}

// proc is one process as /proc shows it.
type proc struct {
	PID, PPID int
	PidNS     string // readlink of /proc/<pid>/ns/pid
	Env       map[string]string
	RawEnv    []byte
	Cmdline   []byte
}

func procs(t *testing.T) []proc {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var out []proc
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err1 := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		cmd, err2 := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		stat, err3 := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err1 != nil || err2 != nil || err3 != nil {
			continue // exited meanwhile or not ours
		}
		p := proc{PID: pid, Env: map[string]string{}, RawEnv: env, Cmdline: cmd}
		p.PidNS, _ = os.Readlink(filepath.Join("/proc", e.Name(), "ns", "pid"))
		// stat: pid (comm) state ppid ...; comm may hold spaces.
		if i := bytes.LastIndexByte(stat, ')'); i > 0 {
			f := strings.Fields(string(stat[i+1:]))
			if len(f) > 1 {
				if f[0] == "Z" {
					continue
				}
				p.PPID, _ = strconv.Atoi(f[1])
			}
		}
		for _, kv := range bytes.Split(env, []byte{0}) {
			k, v, _ := strings.Cut(string(kv), "=")
			p.Env[k] = v
		}
		out = append(out, p)
	}
	return out
}

// wrappersOf returns the wrappers of a sandbox as the host sees them: the
// marked processes in the test's own PID namespace (a wrapper's bubblewrap
// behind the boundary; the wrapper itself without one).
func wrappersOf(t *testing.T, sandbox string) []proc {
	self, err := os.Readlink("/proc/self/ns/pid")
	require.NoError(t, err)
	var ws []proc
	for _, p := range procs(t) {
		if p.Env["AGENTPLANE_SANDBOX"] == sandbox && p.PidNS == self {
			ws = append(ws, p)
		}
	}
	return ws
}

// innerWrappersOf returns the wrapper processes themselves: behind the
// boundary, inside their PID namespaces (argv: <binary> wrapper ...).
func innerWrappersOf(t *testing.T, sandbox string) []proc {
	var ws []proc
	for _, p := range procs(t) {
		args := bytes.Split(p.Cmdline, []byte{0})
		if p.Env["AGENTPLANE_SANDBOX"] == sandbox && len(args) > 1 && string(args[1]) == "wrapper" {
			ws = append(ws, p)
		}
	}
	return ws
}

// runtimesOf returns the runtime processes supervised by wrappers of a
// sandbox: the agent itself, not the bubblewrap that nests it (its two
// processes carry the same environment).
func runtimesOf(t *testing.T, instances map[string]bool) []proc {
	var rs []proc
	for _, p := range runtimeTreesOf(t, instances) {
		if argv0, _, _ := bytes.Cut(p.Cmdline, []byte{0}); filepath.Base(string(argv0)) != "bwrap" {
			rs = append(rs, p)
		}
	}
	return rs
}

// runtimeTreesOf returns every process of the runtimes supervised by
// wrappers of a sandbox, the nesting bubblewrap's included: what must be
// gone once a runtime is stopped.
func runtimeTreesOf(t *testing.T, instances map[string]bool) []proc {
	var rs []proc
	for _, p := range procs(t) {
		if inst, ok := p.Env["AGENTPLANE_RUNTIME_PARENT"]; ok && instances[inst] {
			rs = append(rs, p)
		}
	}
	return rs
}

func instancesOf(ws []proc) map[string]bool {
	m := map[string]bool{}
	for _, w := range ws {
		m[w.Env["AGENTPLANE_INSTANCE"]] = true
	}
	return m
}

// killSandbox kills whatever a test left behind of a sandbox.
func killSandbox(sandbox string) {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if bytes.Contains(env, []byte("AGENTPLANE_SANDBOX="+sandbox+"\x00")) {
			_ = syscall.Kill(-pid, syscall.SIGKILL)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// waitReady prepares a route and waits for its ready notification.
func waitReady(t *testing.T, svc *service, n *fakeNotify, from int, req *sandboxv1.PrepareRequest) (note, int) {
	t.Helper()
	_, err := svc.client.Prepare(context.Background(), req)
	require.NoError(t, err)
	return n.wait(t, from, "ready", req.GetRoute().GetSessionId())
}

func deliver(t *testing.T, svc *service, sandbox, session, id, content string) sandboxv1.DeliveryResult {
	t.Helper()
	resp, err := svc.client.Deliver(context.Background(), &sandboxv1.DeliverRequest{Tenant: testTenant, SandboxId: sandbox, SessionId: session,
		Messages: []*sandboxv1.DeliveryMessage{{MessageId: id, Content: content}}})
	require.NoError(t, err)
	return resp.GetResult()
}

// startStoppableService is startService whose stop the test calls itself.
func startStoppableService(t *testing.T, ctx context.Context, notifyAddr string, mutate func(*server.Config)) (*service, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	var svc *service
	stopped := make(chan struct{})
	svc = startServiceCtx(t, ctx, notifyAddr, mutate, stopped)
	var once sync.Once
	return svc, func() { once.Do(func() { cancel(); <-stopped }) }
}

func itoa(i int) string { return strconv.Itoa(i) }
