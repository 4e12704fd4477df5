package server_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/pkg/testaddr"
	"agentplane.dev/pkg/testenv"
)

// replica is a sandbox-service replica running as its own process.
type replica struct {
	name   string
	addr   string
	cmd    *exec.Cmd
	stderr *logtest.Buffer
	client sandboxv1.SandboxServiceClient
	done   chan struct{}
}

const failoverTTL = time.Second

func startReplica(t *testing.T, name, addr, peers, root, notifyAddr string) *replica {
	cmd := exec.Command(binPath)
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"),
		"AGENTPLANE_REDIS_URL=" + redisSrv.URL(),
		"AGENTPLANE_GRPC_ADDR=" + addr,
		"AGENTPLANE_METRICS_ADDR=",
		"AGENTPLANE_DRAIN_DELAY=0s",
		"AGENTPLANE_SANDBOX_ROOT=" + root,
		"AGENTPLANE_SESSION_ADDR=" + notifyAddr,
		"AGENTPLANE_SANDBOX_PROXY_URL=",
		"AGENTPLANE_SANDBOX_CONTROL_ADDRS=" + peers,
		"AGENTPLANE_SANDBOX_REPLICA=" + name,
		"AGENTPLANE_SANDBOX_OWNER_TTL=" + failoverTTL.String(),
		"AGENTPLANE_SANDBOX_HEARTBEAT=200ms",
		"AGENTPLANE_SANDBOX_DEAD_AFTER=3s",
		"AGENTPLANE_SANDBOX_RECONNECT_WINDOW=20s",
		"AGENTPLANE_LOG_FORMAT=text",
	}
	r := &replica{name: name, addr: addr, cmd: cmd, stderr: &logtest.Buffer{}, done: make(chan struct{})}
	cmd.Stderr = r.stderr
	require.NoError(t, cmd.Start())
	go func() { _ = cmd.Wait(); close(r.done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		<-r.done
		if t.Failed() {
			t.Logf("replica %s stderr:\n%s", name, r.stderr.String())
		}
	})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	r.client = sandboxv1.NewSandboxServiceClient(conn)
	require.Eventually(t, func() bool {
		h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
		return err == nil && h.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}, 30*time.Second, 50*time.Millisecond, "replica %s never answered", name)
	return r
}

func (r *replica) owner(t *testing.T, sb string) (string, uint64) {
	st, err := r.client.Status(context.Background(), &sandboxv1.StatusRequest{Tenant: testTenant, SandboxId: sb})
	if err != nil {
		return "", 0
	}
	return st.GetSandbox().GetOwner(), st.GetSandbox().GetFenceToken()
}

// startPair starts a fake session service and two replicas, A and B, on one
// sandbox root; each lists both as the addresses wrappers dial.
func startPair(t *testing.T) (n *fakeNotify, a, b *replica) {
	n = startNotify(t)
	root := testenv.SandboxRoot(t)
	t.Cleanup(func() { logWrappers(t, root) })
	addrA, addrB := testaddr.Addr(t), testaddr.Addr(t)
	peers := addrA + "," + addrB
	a = startReplica(t, "replica-a", addrA, peers, root, n.addr)
	b = startReplica(t, "replica-b", addrB, peers, root, n.addr)
	return n, a, b
}

// readyOn prepares session s1 on directory dir of a new sandbox through
// replica r and waits for its ready notification (and its index).
func readyOn(t *testing.T, n *fakeNotify, r *replica, dir string) (sandbox string, ready note, i int) {
	t.Helper()
	sandbox = uniqueSandbox(t)
	_, err := r.client.Prepare(context.Background(), route(sandbox, "s1", dir))
	require.NoError(t, err)
	ready, i = n.wait(t, 0, "ready", "s1")
	return sandbox, ready, i
}

// Two replicas on one Redis: the owner paused with SIGSTOP loses the sandbox
// to the other, and its write after SIGCONT is rejected by the fence; the
// owner killed with -9 is replaced by the other. The wrapper follows the
// owner each time (reconnect keeping its route).
func TestOwnerFailoverBetweenReplicas(t *testing.T) {
	n, a, b := startPair(t)
	sb, ready, i := readyOn(t, n, a, "/repo/f")
	owner, tokA := b.owner(t, sb)
	require.Equal(t, "replica-a", owner)
	require.Equal(t, tokA, ready.FenceToken)

	// Pause the owner: B takes the sandbox once A's lease expires.
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGSTOP))
	paused := time.Now()
	var tokB uint64
	require.Eventually(t, func() bool {
		owner, tokB = b.owner(t, sb)
		return owner == "replica-b"
	}, 20*time.Second, 20*time.Millisecond)
	t.Logf("takeover after pause observed in %v (owner TTL %v, renewal every %v)", time.Since(paused), failoverTTL, failoverTTL/3)
	require.Greater(t, tokB, tokA)

	// The wrapper reconnects to B with its route: ready again, same wrapper,
	// reported under B's token.
	again, i := n.wait(t, i+1, "ready", "s1")
	for again.FenceToken != tokB {
		again, i = n.wait(t, i+1, "ready", "s1")
	}
	require.Equal(t, ready.Instance, again.Instance, "the same wrapper kept its route")

	// Resume A: its next write carries the old token and the fence rejects it.
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGCONT))
	require.Eventually(t, func() bool { return strings.Contains(a.stderr.String(), "stale fencing token") }, 20*time.Second, 20*time.Millisecond)
	owner, tok := b.owner(t, sb)
	require.Equal(t, "replica-b", owner)
	require.Equal(t, tokB, tok)
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, &service{client: b.client}, sb, "s1", "m1", "via b"))
	n.wait(t, i, "outcome", "s1")

	// Kill B with -9: A takes the sandbox back.
	require.NoError(t, b.cmd.Process.Kill())
	killed := time.Now()
	var tokA2 uint64
	require.Eventually(t, func() bool {
		owner, tokA2 = a.owner(t, sb)
		return owner == "replica-a"
	}, 20*time.Second, 20*time.Millisecond)
	t.Logf("takeover after kill -9 observed in %v (owner TTL %v, renewal every %v)", time.Since(killed), failoverTTL, failoverTTL/3)
	require.Greater(t, tokA2, tokB)
	back, _ := n.wait(t, i+1, "ready", "s1")
	for back.FenceToken != tokA2 {
		back, i = n.wait(t, i+1, "ready", "s1")
	}
	require.Equal(t, ready.Instance, back.Instance)
}

// A replica killed with -9 loses the notifications it had not forwarded: its
// queue is in memory. The wrapper sends its recent turn outcomes again on
// each new stream, so the replica that takes over forwards the outcome and
// the session's message does not wait for the no_outcome backstop.
func TestOutcomeSurvivesOwnerKill(t *testing.T) {
	n, a, b := startPair(t)
	sb, _, i := readyOn(t, n, a, "/repo/replay")

	// The session service refuses the turn's outcome: A holds it, retrying.
	n.refuseOutcomes.Store(true)
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, &service{client: a.client}, sb, "s1", "m1", "hello"))
	require.Eventually(t, func() bool { return n.refused.Load() > 0 }, 30*time.Second, 10*time.Millisecond,
		"replica A forwards the outcome")
	require.NoError(t, a.cmd.Process.Kill())
	<-a.done
	n.refuseOutcomes.Store(false)

	require.Eventually(t, func() bool { owner, _ := b.owner(t, sb); return owner == "replica-b" }, 20*time.Second, 20*time.Millisecond)
	out, _ := n.wait(t, i, "outcome", "s1")
	require.Equal(t, "m1", out.Text)
	require.Equal(t, "TURN_RESULT_SUCCEEDED", out.Reason)
}
