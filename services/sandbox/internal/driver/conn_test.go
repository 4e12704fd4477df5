package driver

import (
	"context"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/sandbox/internal/allocation"
	"agentplane.dev/services/sandbox/internal/notify"
	"agentplane.dev/services/sandbox/internal/provider"
)

// A stream the driver ends says why: a newer Hello of the same runtime key
// replaces the older stream, and the replica's shutdown ends the rest.
func TestWrapperStreamsEndWithTheirReason(t *testing.T) {
	rs := redistest.Start(t)
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := New(Config{
		Redis: rs.Client(t), Provider: prov, Wrappers: wr, Notifier: notify.New(nil, slog.New(slog.DiscardHandler), 0),
		Credentials: &mintRecorder{contracts: map[string]credentialv1.RuntimeContract{}},
		ReplicaID:   "r1", OwnerTTL: 10 * time.Second, Timers: allocation.DefaultTimers(), WrapperCommand: []string{"wrapper"},
	})
	t.Cleanup(d.dropAll)
	ctx := context.Background()

	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: "sbx-reasons", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	w := <-prov.launched
	token, err := strconv.ParseUint(w.arg("--fence-token"), 10, 64)
	require.NoError(t, err)
	hello := func() *Conn {
		res, err := d.Hello(ctx, &sandboxv1.Hello{
			SandboxId: "sbx-reasons", AllocationId: w.arg("--allocation"), RuntimeKey: w.markers.RuntimeKey,
			InstanceId: w.markers.InstanceID, Generation: w.markers.Generation, FenceToken: token,
			LaunchCredential: w.credential, ProtocolVersion: 1, Capabilities: []string{"worktree"},
		})
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
