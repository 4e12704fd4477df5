package driver

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/reconciler"
	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
}

// launchedWrapper is what a launch handed the wrapper: its markers, its
// command line and the launch credential from fd 3.
type launchedWrapper struct {
	markers    provider.Markers
	args       []string
	credential string
}

func (w launchedWrapper) arg(name string) string {
	i := slices.Index(w.args, name)
	if i < 0 || i+1 >= len(w.args) {
		return ""
	}
	return w.args[i+1]
}

// newTestDriver is a driver on a private redis-server over the test's
// provider, wrapper-lease layer and credential service (nil: none). The
// caller runs or drops it.
func newTestDriver(t *testing.T, prov provider.AgentSandbox, wr Wrappers, creds Credentials) *Driver {
	return New(Config{
		Redis: redistest.Start(t).Client(t), Provider: prov, Wrappers: wr, Credentials: creds,
		Notifier:  quietNotifier{},
		ReplicaID: "r1", OwnerTTL: 10 * time.Second, Timers: allocation.DefaultTimers(), WrapperCommand: []string{"wrapper"},
	})
}

// quietNotifier drops every notification (the tests read the driver's
// state and frames, not the session service's).
type quietNotifier struct{}

func (quietNotifier) Progress(RouteRef, ProgressStep) {}
func (quietNotifier) Ready(RouteRef, string, string)  {}
func (quietNotifier) Reconnecting(RouteRef)           {}
func (quietNotifier) Failed(RouteRef, string, bool)   {}
func (quietNotifier) Lost(RouteRef, string)           {}
func (quietNotifier) Events(RouteRef, []RuntimeEvent) {}
func (quietNotifier) Outcome(RouteRef, TurnOutcome)   {}

// hello is the Hello the launched wrapper would say, with its launch
// credential and the fencing token it was launched under.
func (w launchedWrapper) hello(t *testing.T, sandboxID string, capabilities ...string) Hello {
	token, err := strconv.ParseUint(w.arg("--fence-token"), 10, 64)
	require.NoError(t, err)
	return Hello{
		SandboxID: sandboxID, AllocationID: w.arg("--allocation"), RuntimeKey: w.markers.RuntimeKey,
		InstanceID: w.markers.InstanceID, Generation: w.markers.Generation, FenceToken: token,
		LaunchCredential: w.credential, ProtocolVersion: 1, Capabilities: capabilities,
	}
}

// recordingProvider launches nothing: it records what a launch would hand
// the wrapper, so the test can say the wrapper's Hello itself.
type recordingProvider struct{ launched chan launchedWrapper }

func (p *recordingProvider) Create(context.Context, string) error { return nil }
func (p *recordingProvider) Launch(_ context.Context, spec provider.LaunchSpec) (provider.Observed, error) {
	id := spec.Identity
	args := append(slices.Clone(spec.Args), "--allocation", id.Allocation, "--fence-token", strconv.FormatUint(id.FenceToken, 10))
	p.launched <- launchedWrapper{markers: spec.Markers, args: args, credential: id.Credential}
	return provider.Observed{InstanceID: spec.Markers.InstanceID, Generation: spec.Markers.Generation}, nil
}
func (p *recordingProvider) Discover(context.Context, string, string) provider.Discovery {
	return provider.Discovery{Kind: provider.Absent}
}
func (p *recordingProvider) Stop(context.Context, provider.StopTarget) provider.StopResult {
	return provider.StopResult{}
}
func (p *recordingProvider) KeepAlive(context.Context, string) error { return nil }
func (p *recordingProvider) Capacity(context.Context, string) provider.Capacity {
	return provider.Capacity{}
}
func (p *recordingProvider) Delete(context.Context, string, string, provider.DeleteReason) error {
	return nil
}

// heldWrappers is a wrapper-lease layer that always launches, and holds the
// EnsureWrapper of one runtime key after its launch until released: the
// window in which the launching preparation is still running while the new
// wrapper's Hello arrives.
type heldWrappers struct {
	holdKey  string
	held     chan struct{} // closed once the held EnsureWrapper launched
	release  chan struct{}
	stopped  chan string // runtime keys whose stop was requested
	mu       sync.Mutex
	ensured  []string
	launched map[string]provider.Markers
	instance int
}

func (w *heldWrappers) Adopt(context.Context, string, reconciler.Fence) error { return nil }
func (w *heldWrappers) Forget(string)                                         {}
func (w *heldWrappers) EnsureWrapper(ctx context.Context, sandboxID, key string, launch reconciler.LaunchFunc) (reconciler.Decision, error) {
	w.mu.Lock()
	w.ensured = append(w.ensured, key)
	if m, ok := w.launched[key]; ok {
		// As the reconciler does: the key's one wrapper runs, reuse it.
		w.mu.Unlock()
		return reconciler.Decision{Action: reconciler.Reused, Markers: m}, nil
	}
	w.instance++
	m := provider.Markers{SandboxID: sandboxID, RuntimeKey: key, InstanceID: "wi-" + strconv.Itoa(w.instance), Generation: 1}
	w.launched[key] = m
	w.mu.Unlock()
	if err := launch(ctx, m); err != nil {
		return reconciler.Decision{}, err
	}
	if key == w.holdKey {
		close(w.held)
		<-w.release
	}
	return reconciler.Decision{Action: reconciler.Launched, Markers: m}, nil
}
func (w *heldWrappers) StartupVerified(context.Context, string, string, string) error  { return nil }
func (w *heldWrappers) DeliveryAccepted(context.Context, string, string, string) error { return nil }
func (w *heldWrappers) RetainWarm(context.Context, string, string, string, time.Time) error {
	return nil
}
func (w *heldWrappers) WrapperGone(context.Context, string, string, string) error { return nil }
func (w *heldWrappers) RequestStop(_ context.Context, _, key, _ string) error {
	w.stopped <- key
	return nil
}
func (w *heldWrappers) DeletionAllowed(ctx context.Context, sb, key string) (bool, time.Duration, error) {
	return w.AbsenceVerified(ctx, sb, key)
}
func (w *heldWrappers) AbsenceVerified(context.Context, string, string) (bool, time.Duration, error) {
	return true, 0, nil
}
func (w *heldWrappers) Lease(context.Context, string, string) (lease.Lease, error) {
	return lease.Lease{}, nil
}

func (w *heldWrappers) ensuredKeys() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.ensured)
}

// TestPerSessionPinWhileFirstPrepareRuns reproduces the race of a
// directory's first wrapper announcing no worktree capability while the
// preparation that launched it is still running: the Hello pins per_session,
// stops the directory-keyed wrapper and starts preparing the route again to be
// re-keyed by its session id, but that start found the route still being prepared and was
// dropped, so the route waited for a wrapper that had just been stopped.
func TestPerSessionPinWhileFirstPrepareRuns(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{holdKey: "/repo", held: make(chan struct{}), release: make(chan struct{}), stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, nil)
	t.Cleanup(d.dropAll)
	ctx := context.Background()

	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: "sbx-race", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	w := <-prov.launched
	<-wr.held // the preparation that launched the wrapper is still running

	res, err := d.Hello(ctx, w.hello(t, "sbx-race")) // no worktree capability: per_session
	require.NoError(t, err)
	require.NotNil(t, res.Shutdown, "the directory-keyed wrapper goes under per_session")
	require.Equal(t, "/repo", <-wr.stopped)
	// The Hello's start of preparation runs right after the stop request; let it land while
	// the first preparation still drives the route.
	d.mu.Lock()
	sb := d.sandboxes["sbx-race"]
	d.mu.Unlock()
	require.Eventually(t, func() bool {
		sb.mu.Lock()
		defer sb.mu.Unlock()
		return sb.prepareAgain["s1"]
	}, 10*time.Second, time.Millisecond)
	close(wr.release)

	require.Eventually(t, func() bool { return slices.Contains(wr.ensuredKeys(), "s1") }, 10*time.Second, 5*time.Millisecond,
		"the route is prepared again under its per_session runtime key; asked for %v", wr.ensuredKeys())
	r, ok, err := d.Route(ctx, "sbx-race", "s1")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "s1", r.RuntimeKey)
}

// mintRecorder is a credential port that answers Mint (or fails it with
// mintErr) and RetireScope, and records the contract each route was minted
// under.
type mintRecorder struct {
	Credentials // any other call panics
	mintErr     error
	mu          sync.Mutex
	contracts   map[string]scope.Contract
	calls       []string // RetireScope and Mint, in order
}

func (m *mintRecorder) RetireScope(context.Context, ScopeRef, uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, "retire:wrapper_restart")
	return nil
}

func (m *mintRecorder) Mint(_ context.Context, req Mint) (string, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.contracts[req.SessionID] = req.Contract
	m.calls = append(m.calls, "mint")
	if m.mintErr != nil {
		return "", false, m.mintErr
	}
	return "h-" + req.SessionID, false, nil
}

// TestRoutesKeyedBeforeTheFirstHelloMintUnderItsContract: two sessions of
// one directory prepared close together, both before the directory's first
// wrapper said Hello (so neither saw a contract when it was keyed), are
// minted and prepared under the worktree contract that Hello pinned, on the
// one wrapper.
func TestRoutesKeyedBeforeTheFirstHelloMintUnderItsContract(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{holdKey: "/repo", held: make(chan struct{}), release: make(chan struct{}), stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	creds := &mintRecorder{contracts: map[string]scope.Contract{}}
	d := newTestDriver(t, prov, wr, creds)
	t.Cleanup(d.dropAll)
	ctx := context.Background()

	for _, id := range []string{"s1", "s2"} {
		_, err := d.Prepare(ctx, RouteSpec{SessionID: id, SandboxID: "sbx-pin", Directory: "/repo", CredentialClass: "static"})
		require.NoError(t, err)
	}
	w := <-prov.launched
	<-wr.held

	res, err := d.Hello(ctx, w.hello(t, "sbx-pin", "worktree"))
	require.NoError(t, err)
	require.NotNil(t, res.Conn)
	require.Equal(t, scope.Worktree, res.Ack.Contract)
	close(wr.release)

	prepared := map[string]scope.Contract{}
	for len(prepared) < 2 {
		select {
		case f := <-res.Conn.Send:
			if p, ok := f.(PrepareRoute); ok {
				prepared[p.SessionID] = p.Contract
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("PrepareRoute frames seen: %v", prepared)
		}
	}
	want := scope.Worktree
	require.Equal(t, map[string]scope.Contract{"s1": want, "s2": want}, prepared)
	creds.mu.Lock()
	defer creds.mu.Unlock()
	require.Equal(t, map[string]scope.Contract{"s1": scope.Worktree, "s2": scope.Worktree}, creds.contracts)
	// A route may be sent twice (by the Hello, and by its preparation
	// finding the wrapper connected), each time with a handle minted for
	// it: the order is what matters.
	require.Equal(t, "retire:wrapper_restart", creds.calls[0],
		"a fresh wrapper's Hello retires the scope's accepted handles before any mint: %v", creds.calls)
	for _, c := range creds.calls[1:] {
		require.Equal(t, "mint", c, "%v", creds.calls)
	}
	wr.mu.Lock()
	defer wr.mu.Unlock()
	require.Len(t, wr.launched, 1, "one wrapper for the directory")
}

// TestPrepareWhileRunStarts: the gRPC server takes calls before the
// driver's loop has started, so a Prepare can race Run's start. Under the
// race detector (make test) this failed while Run set the parent context
// of owned sandboxes; every sandbox must still stop when Run stops.
func TestPrepareWhileRunStarts(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, nil)
	runCtx, stopRun := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { d.Run(runCtx); close(ran) }()

	_, err := d.Prepare(context.Background(), RouteSpec{SessionID: "s1", SandboxID: "sbx-early", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	<-prov.launched
	d.mu.Lock()
	sb := d.sandboxes["sbx-early"]
	d.mu.Unlock()
	require.NotNil(t, sb)

	stopRun()
	<-ran
	select {
	case <-sb.ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a sandbox owned before Run started outlived Run")
	}
}
