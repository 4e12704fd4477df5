package server_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/ownership"
)

// A replica stopped with SIGTERM gives its sandboxes up before it closes
// Redis, so another replica can take them over at once rather than after the
// owner TTL, and it logs no failed state write on the way out. (The driver's
// loop used to stop after Redis was closed: its releases failed with "client
// is closed" and the leases stayed.)
func TestSigtermReleasesOwnership(t *testing.T) {
	n := startNotify(t)
	addr := freeAddr(t)
	r := startReplica(t, "r-term", addr, addr, t.TempDir(), n.addr)
	sb := uniqueSandbox(t)
	_, err := r.client.Prepare(context.Background(), route(sb, "s1", "/repo/term"))
	require.NoError(t, err)
	n.wait(t, 0, "ready", "s1")
	rdb := redisSrv.Client(t)
	owner, _, err := ownership.Current(context.Background(), rdb, sb)
	require.NoError(t, err)
	require.Equal(t, "r-term", owner)

	require.NoError(t, r.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-r.done:
	case <-time.After(60 * time.Second):
		t.Fatal("the replica did not exit after SIGTERM")
	}
	require.Zero(t, r.cmd.ProcessState.ExitCode(), "a clean exit")
	owner, _, err = ownership.Current(context.Background(), rdb, sb)
	require.NoError(t, err)
	require.Empty(t, owner, "the stopped replica released its sandbox")
	require.NotContains(t, r.stderr.String(), "state write failed")
	require.NotContains(t, r.stderr.String(), "client is closed")
	// The wrapper's stream ends saying why: this replica's shutdown, not a
	// replaced stream or a moved sandbox.
	require.Regexp(t, `grpc.method=Connect .*code = Unavailable desc = this sandbox-service replica is shutting down; reconnect`, r.stderr.String())
}
