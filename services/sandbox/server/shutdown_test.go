package server_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/testaddr"
	"agentplane.dev/pkg/testenv"
	"agentplane.dev/services/sandbox/internal/control/ownership"
	"agentplane.dev/services/sandbox/server"
)

// A replica stopped with SIGTERM gives its sandboxes up before it closes
// Redis, so another replica can take them over at once rather than after the
// owner TTL, and it logs no failed state write on the way out. (The driver's
// loop used to stop after Redis was closed: its releases failed with "client
// is closed" and the leases stayed.)
func TestSigtermReleasesOwnership(t *testing.T) {
	n := startNotify(t)
	addr := testaddr.Addr(t)
	r := startReplica(t, "r-term", addr, addr, testenv.SandboxRoot(t), n.addr)
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

// A turn outcome still queued when the replica stops (the session service
// was down) goes out during the shutdown once the session service answers
// again, instead of being lost and leaving its message accepted until the
// session's no_outcome backstop.
func TestShutdownSendsQueuedNotifications(t *testing.T) {
	n := startNotify(t)
	// The drain's bound is not what this test is about (the order is: the outcome is sent
	// during shutdown, after the session service is back), so it is long: with the default
	// 5 s a loaded machine could see the session service back only after the drain's
	// doubling backoff had passed its bound.
	svc, stop := startStoppableService(t, context.Background(), n.addr, func(c *server.Config) { c.NotifyDrain = 2 * time.Minute })
	sb := uniqueSandbox(t)
	_, i := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/drain"))

	// Outcomes are refused (the rest goes through, so nothing queued ahead
	// holds the outcome back): once one was refused, the outcome is queued
	// in this replica. A refusal of an earlier notification alone could
	// come before the wrapper's outcome reached this replica, which a stop
	// would then never see.
	n.refuseOutcomes.Store(true)
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m1", "hello"))
	require.Eventually(t, func() bool { return n.refusedOutcomes.Load() > 0 }, 30*time.Second, 10*time.Millisecond,
		"the turn's outcome is being retried")

	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	// The session service comes back only once this replica stopped
	// serving, when its notifier's loop is ending or has ended.
	require.Eventually(t, func() bool {
		_, err := svc.client.Status(context.Background(), &sandboxv1.StatusRequest{Tenant: testTenant, SandboxId: sb})
		return err != nil
	}, 30*time.Second, 5*time.Millisecond)
	n.refuseOutcomes.Store(false)
	<-stopped

	out, _, ok := n.find(i, "outcome", "s1")
	require.True(t, ok, "the outcome was delivered during shutdown; got %+v", n.all()[i:])
	require.Equal(t, "m1", out.Text)
}
