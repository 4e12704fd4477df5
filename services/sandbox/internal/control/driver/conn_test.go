package driver

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// A stream the driver ends says why: a newer Hello of the same runtime key
// replaces the older stream, and the replica's shutdown ends the rest.
func TestWrapperStreamsEndWithTheirReason(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, &mintRecorder{contracts: map[string]scope.Contract{}})
	t.Cleanup(d.dropAll)
	ctx := context.Background()

	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: "sbx-reasons", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	w := <-prov.launched
	hello := func() *Conn {
		res, err := d.Hello(ctx, w.hello(t, "sbx-reasons", "worktree"))
		require.NoError(t, err)
		require.NotNil(t, res.Conn, "shutdown: %v", res.Shutdown)
		return res.Conn
	}
	first := hello()
	second := hello() // the wrapper reconnected before its old stream ended
	select {
	case <-first.Closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the replaced stream stayed open")
	}
	require.ErrorIs(t, first.Err(), ErrStreamReplaced)

	d.CloseWrapperStreams()
	<-second.Closed
	require.ErrorIs(t, second.Err(), ErrShuttingDown)
	_, err = d.Hello(ctx, Hello{SandboxID: "sbx-reasons"})
	require.ErrorIs(t, err, ErrShuttingDown, "no new streams while shutting down")
}

// A handle the credential port cannot mint fails the route retryably with
// credential_unavailable, and no PrepareRoute reaches the wrapper: the
// minting path over a fake port, no credential server.
func TestMintFailureFailsTheRoute(t *testing.T) {
	creds := &mintRecorder{contracts: map[string]scope.Contract{}, mintErr: errors.New("credential service down")}
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	d := newTestDriver(t, prov, &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}, creds)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	spec := RouteSpec{SessionID: "s1", SandboxID: "sbx-mint", Directory: "/repo", CredentialClass: "static"}
	if _, err := d.Prepare(ctx, spec); err != nil {
		t.Fatal(err)
	}
	res, err := d.Hello(ctx, (<-prov.launched).hello(t, spec.SandboxID, "worktree"))
	require.NoError(t, err)
	require.NotNil(t, res.Conn, "shutdown: %v", res.Shutdown)

	require.Eventually(t, func() bool {
		r, _, err := d.Route(ctx, "sbx-mint", "s1")
		return err == nil && r.State == store.RouteFailed
	}, 10*time.Second, 5*time.Millisecond, "the route fails once the mint failed")
	r, _, err := d.Route(ctx, "sbx-mint", "s1")
	require.NoError(t, err)
	require.Equal(t, "credential_unavailable", r.FailureReason)
	require.True(t, r.Retryable)
	creds.mu.Lock()
	require.Equal(t, []string{"retire:wrapper_restart", "mint"}, creds.calls)
	require.Equal(t, scope.Worktree, creds.contracts["s1"])
	creds.mu.Unlock()
	for len(res.Conn.Send) > 0 {
		_, prepare := (<-res.Conn.Send).(PrepareRoute)
		require.False(t, prepare, "no PrepareRoute without a handle")
	}
}
