package driver

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// rotatingCredentials is a credential port that behaves as the service does
// for one worktree scope: the first mint issues the canonical handle, later
// mints adopt it, and a rotation replaces it. It records the rotations.
type rotatingCredentials struct {
	mu         sync.Mutex
	canonical  string
	issued     int
	rotations  []rotation
	validUntil time.Time
}

type rotation struct {
	scope ScopeRef
	fence uint64
}

func (c *rotatingCredentials) Mint(context.Context, Mint) (string, bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.canonical != "" {
		return c.canonical, true, nil
	}
	c.issued++
	c.canonical = "h" + strconv.Itoa(c.issued)
	return c.canonical, false, nil
}

func (c *rotatingCredentials) ReleaseMember(context.Context, ScopeRef, string, uint64) error {
	return nil
}

func (c *rotatingCredentials) RetireScope(context.Context, ScopeRef, uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.canonical = ""
	return nil
}

func (c *rotatingCredentials) RotateHandle(_ context.Context, s ScopeRef, fence uint64) (string, time.Time, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rotations = append(c.rotations, rotation{scope: s, fence: fence})
	c.issued++
	c.canonical = "h" + strconv.Itoa(c.issued)
	return c.canonical, c.validUntil, nil
}

// nextFrame is the next frame of type F on the wrapper's stream; other
// frames are skipped.
func nextFrame[F ToWrapper](t *testing.T, c *Conn) F {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case f := <-c.Send:
			if x, ok := f.(F); ok {
				return x
			}
		case <-timeout:
			var zero F
			t.Fatalf("no %T frame on the stream", zero)
			return zero
		}
	}
}

// Issue 17, handle rotation during a session, at the driver: RotateHandle
// asks the credential port to rotate the worktree scope's handle under the
// owner's fence, pushes the new handle to the connected wrapper for every
// route of the runtime (a HandleUpdate: the wrapper's relay uses it on the
// agent's next request, no restart), and the routes hold it from then on:
// a reconnecting wrapper is given the new handle, not the old one. With no
// wrapper connected, nothing is rotated.
func TestRotateHandlePushesTheNewHandleToTheWrapper(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	creds := &rotatingCredentials{validUntil: time.Unix(1800000000, 0)}
	d := newTestDriver(t, prov, wr, creds)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	const sbx = "sbx-rotate"
	for _, id := range []string{"s1", "s2"} {
		_, err := d.Prepare(ctx, RouteSpec{SessionID: id, SandboxID: sbx, Directory: "/repo", CredentialClass: "static"})
		require.NoError(t, err)
	}
	w := <-prov.launched
	res, err := d.Hello(ctx, w.hello(t, sbx, "worktree"))
	require.NoError(t, err)
	require.NotNil(t, res.Conn, "shutdown: %v", res.Shutdown)
	c := res.Conn

	rsids := map[string]string{}
	for len(rsids) < 2 {
		p := nextFrame[PrepareRoute](t, c)
		require.Equal(t, "h1", p.Handle, "the siblings share the canonical handle")
		rsids[p.SessionID] = p.RuntimeSessionID
	}
	for id, rsid := range rsids {
		d.Frame(c, RouteReady{SessionID: id, RuntimeSessionID: rsid})
	}
	require.Eventually(t, func() bool {
		for id := range rsids {
			if r, _, err := d.Route(ctx, sbx, id); err != nil || r.State != store.RouteReady {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond)

	rot, err := d.RotateHandle(ctx, sbx, "s1")
	require.NoError(t, err)
	require.Equal(t, []string{"s1", "s2"}, rot.Sessions)
	require.Equal(t, creds.validUntil, rot.PreviousValidUntil)
	require.Equal(t, HandleUpdate{SessionIDs: []string{"s1", "s2"}, Handle: "h2"}, nextFrame[HandleUpdate](t, c))
	fence, err := strconv.ParseUint(w.arg("--fence-token"), 10, 64)
	require.NoError(t, err)
	creds.mu.Lock()
	require.Equal(t, []rotation{{scope: ScopeRef{SandboxID: sbx, Directory: "/repo"}, fence: fence}}, creds.rotations)
	creds.mu.Unlock()

	// The rotation's frame may be lost with its stream: the same wrapper's
	// reconnect is given the handle the routes hold now.
	h := w.hello(t, sbx, "worktree")
	for id, rsid := range rsids {
		h.Routes = append(h.Routes, ActiveRoute{SessionID: id, RuntimeSessionID: rsid})
	}
	again, err := d.Hello(ctx, h)
	require.NoError(t, err)
	require.NotNil(t, again.Conn, "shutdown: %v", again.Shutdown)
	resent := nextFrame[HandleUpdate](t, again.Conn)
	require.Equal(t, "h2", resent.Handle, "the reconnected wrapper gets the rotated handle, not the old one")
	require.ElementsMatch(t, []string{"s1", "s2"}, resent.SessionIDs)

	d.Disconnected(again.Conn)
	_, err = d.RotateHandle(ctx, sbx, "s1")
	require.ErrorIs(t, err, ErrWorktreeUnavailable, "no connected wrapper could take a new handle")
	creds.mu.Lock()
	require.Len(t, creds.rotations, 1, "nothing was rotated for a wrapper that is not connected")
	creds.mu.Unlock()
}

// releasingWrappers runs onStartup (once armed) where Hello reports the
// startup verified: after it released sb.mu, before it reads the resumed
// routes again.
type releasingWrappers struct {
	*heldWrappers
	onStartup func()
}

func (w *releasingWrappers) StartupVerified(context.Context, string, string, string) error {
	if w.onStartup != nil {
		w.onStartup()
	}
	return nil
}

// Issue 33 item 11: a reconnecting wrapper's Hello read a resumed route
// again after releasing sb.mu; a ReleaseRoute that removed it meanwhile
// made that read a nil dereference.
func TestHelloSurvivesARouteReleasedMeanwhile(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &releasingWrappers{heldWrappers: &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}}
	d := newTestDriver(t, prov, wr, nil)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	const sbx = "sbx-hello-release"
	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: sbx, Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	w := <-prov.launched
	res, err := d.Hello(ctx, w.hello(t, sbx, "worktree"))
	require.NoError(t, err)
	require.NotNil(t, res.Conn, "shutdown: %v", res.Shutdown)
	p := nextFrame[PrepareRoute](t, res.Conn)
	d.Frame(res.Conn, RouteReady{SessionID: "s1", RuntimeSessionID: p.RuntimeSessionID})
	require.Eventually(t, func() bool {
		r, _, err := d.Route(ctx, sbx, "s1")
		return err == nil && r.State == store.RouteReady
	}, 10*time.Second, 5*time.Millisecond)

	d.mu.Lock()
	sb := d.sandboxes[sbx]
	d.mu.Unlock()
	wr.onStartup = func() { // what a ReleaseRoute's removal does, at the worst moment
		sb.mu.Lock()
		delete(sb.routes, "s1")
		sb.mu.Unlock()
	}
	h := w.hello(t, sbx, "worktree")
	h.Routes = []ActiveRoute{{SessionID: "s1", RuntimeSessionID: p.RuntimeSessionID}}
	again, err := d.Hello(ctx, h)
	require.NoError(t, err)
	require.NotNil(t, again.Conn, "shutdown: %v", again.Shutdown)
}
