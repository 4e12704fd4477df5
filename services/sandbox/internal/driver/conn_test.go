package driver

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/provider"
)

// A stream the driver ends says why: a newer Hello of the same runtime key
// replaces the older stream, and the replica's shutdown ends the rest.
func TestWrapperStreamsEndWithTheirReason(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, &mintRecorder{contracts: map[string]credentialv1.RuntimeContract{}})
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
	_, err = d.Hello(ctx, &sandboxv1.Hello{SandboxId: "sbx-reasons"})
	require.ErrorIs(t, err, ErrShuttingDown, "no new streams while shutting down")
}
