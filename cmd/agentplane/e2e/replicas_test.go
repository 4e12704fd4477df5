package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/testaddr"
)

// balancer is a round-robin TCP balancer standing in for a Kubernetes
// ClusterIP Service: each new connection goes to the next backend (a
// backend that refuses is skipped, as kube-proxy drops an endpoint whose
// pod is gone); it knows nothing of gRPC or of owners.
type balancer struct {
	lis      net.Listener
	backends []string
	next     atomic.Uint64
}

func startBalancer(t *testing.T, backends ...string) *balancer {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	b := &balancer{lis: lis, backends: backends}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = lis.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { b.proxy(c) })
		}
	})
	return b
}

func (b *balancer) addr() string { return b.lis.Addr().String() }

func (b *balancer) proxy(c net.Conn) {
	defer c.Close()
	var up net.Conn
	for range b.backends {
		addr := b.backends[b.next.Add(1)%uint64(len(b.backends))]
		var err error
		if up, err = net.DialTimeout("tcp", addr, time.Second); err == nil {
			break
		}
	}
	if up == nil {
		return
	}
	defer up.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
}

// sandboxReplica is one sandbox-service replica as its own process.
type sandboxReplica struct {
	*proc
	addr    string
	metrics string // its /metrics URL
	conn    grpc.ClientConnInterface
	client  sandboxv1.SandboxServiceClient
}

const replicaOwnerTTL = 2 * time.Second

// startSandboxReplica starts replica name of the stack's sandbox service
// on addr; wrappers dial controlAddr (the balancer, as they would dial the
// Service); kv overrides more settings.
func (st *stack) startSandboxReplica(name, addr, controlAddr string, kv ...string) *sandboxReplica {
	t := st.t
	metrics := testaddr.Addr(t)
	r := &sandboxReplica{addr: addr, metrics: "http://" + metrics + "/metrics", proc: st.process(svcSandbox, name, append([]string{
		"GRPC_ADDR", addr, "SANDBOX_ADVERTISE_ADDR", addr, "SANDBOX_CONTROL_ADDRS", controlAddr,
		"SANDBOX_OWNER_TTL", replicaOwnerTTL.String(), "SANDBOX_HEARTBEAT", "200ms",
		"SANDBOX_DEAD_AFTER", "3s", "SANDBOX_RECONNECT_WINDOW", "60s", "LOG_FORMAT", "text",
		"SANDBOX_EMPTY_GRACE", "10m", "METRICS_ADDR", metrics,
	}, kv...)...)}
	r.conn = st.dial(addr)
	r.client = sandboxv1.NewSandboxServiceClient(r.conn)
	require.Eventually(t, func() bool { return serving(r.conn) }, 60*time.Second, 50*time.Millisecond, "replica %s never answered", name)
	return r
}

// e2eTenant is the tenant of the suites' sessions (o-e2e/u-e2e).
var e2eTenant = &sandboxv1.Tenant{OrgId: "o-e2e", UserId: "u-e2e"}

// warm makes the replica c reaches own sandboxID before any session exists:
// the sandbox is claimed for e2eTenant, and a release of an unknown session
// makes the replica asked take it (it must verify the session's key absent);
// the replicas keep an empty sandbox for SANDBOX_EMPTY_GRACE (10m here).
// An Abort no longer does: a call that only talks to a route never takes a
// sandbox over (issue 33 item 4).
func warm(t *testing.T, c sandboxv1.SandboxServiceClient, sandboxID string) {
	_, err := c.ClaimSandbox(context.Background(), &sandboxv1.ClaimSandboxRequest{SandboxId: sandboxID, Tenant: e2eTenant})
	require.NoError(t, err)
	_, err = c.Abort(context.Background(), &sandboxv1.AbortRequest{SandboxId: sandboxID, SessionId: "warm", MessageId: "warm", Tenant: e2eTenant})
	require.Equal(t, "ROUTE_NOT_FOUND", apierr.Reason(err), "%v", err)
	_, err = c.ReleaseRoute(context.Background(), &sandboxv1.ReleaseRouteRequest{SandboxId: sandboxID, SessionId: "warm", Reason: "warm", Tenant: e2eTenant})
	require.NoError(t, err)
}

// serving reports whether the server on conn answers health SERVING.
func serving(conn grpc.ClientConnInterface) bool {
	h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	return err == nil && h.GetStatus() == healthpb.HealthCheckResponse_SERVING
}

func (r *sandboxReplica) owner(sandboxID string) string {
	return r.ownerFor(e2eTenant, sandboxID)
}

// ownerFor is owner for a sandbox of tenant tn: Status names the tenant,
// and another tenant's Status is refused (SANDBOX_TENANT_MISMATCH), which
// reads here as no owner.
func (r *sandboxReplica) ownerFor(tn *sandboxv1.Tenant, sandboxID string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := r.client.Status(ctx, &sandboxv1.StatusRequest{SandboxId: sandboxID, Tenant: tn})
	if err != nil {
		return ""
	}
	return st.GetSandbox().GetOwner()
}

// waitCompleted polls the message until it completes (fails on FAILED).
func waitCompleted(t *testing.T, ses sessionv1.SessionServiceClient, sessionID, messageID string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, err := ses.GetMessage(context.Background(), &sessionv1.GetMessageRequest{SessionId: sessionID, MessageId: messageID})
		if err == nil {
			switch resp.GetMessage().GetState() {
			case sessionv1.MessageState_MESSAGE_STATE_COMPLETED:
				return
			case sessionv1.MessageState_MESSAGE_STATE_FAILED, sessionv1.MessageState_MESSAGE_STATE_CANCELLED:
				t.Fatalf("message %s/%s ended %v", sessionID, messageID, resp.GetMessage())
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("message %s/%s not completed within %v (last: %v, err %v)", sessionID, messageID, within, resp.GetMessage(), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestOwnerAwareRoutingBehindABalancer (issue 20): two sandbox replicas,
// separate processes, behind a round-robin TCP balancer that the session
// service and the wrappers dial as their one sandbox address. 8 sessions
// over 4 sandboxes get their first messages completed and their deletions
// finish (calls that reach the non-owner are sent to the owner it names);
// kill -9 of the replica owning a sandbox moves that sandbox to the other
// replica and its sessions complete their next message.
func TestOwnerAwareRoutingBehindABalancer(t *testing.T) {
	st := newStack(t, stackOptions{})
	st.releaseListeners(svcSandbox)
	run := st.run
	addrA, addrB := testaddr.Addr(t), testaddr.Addr(t)
	lb := startBalancer(t, addrA, addrB)
	// Without a proxy and credential service: this test is about routing.
	a := st.startSandboxReplica("replica-a", addrA, lb.addr(), "SANDBOX_PROXY_URL", "", "CREDENTIAL_ADDR", "")
	b := st.startSandboxReplica("replica-b", addrB, lb.addr(), "SANDBOX_PROXY_URL", "", "CREDENTIAL_ADDR", "")

	logs := captureStderr(t)
	st.set(svcSession, "SANDBOX_ADDR", lb.addr(), "CREDENTIAL_ADDR", "", "INGEST_ADDR", "",
		"SESSION_RECONCILE_INTERVAL", "200ms", "SESSION_DELETE_BACKOFF_BASE", "200ms", "SESSION_DELETE_BACKOFF_MAX", "2s")
	st.runInProcess(nil, svcSession)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("session log:\n%s", logs.String())
		}
	})
	ses := st.suite().ses
	var err error

	// Each replica takes two of the four sandboxes before any session
	// exists (Abort of an unknown message makes the replica asked own the
	// sandbox): the session service's one connection through the balancer
	// reaches one replica, so half the sandboxes are owned by the other.
	for i := range 4 {
		r := a
		if i >= 2 {
			r = b
		}
		warm(t, r.client, fmt.Sprintf("sbx-lb%d-%s", i, run))
		require.Equal(t, r.name, r.owner(fmt.Sprintf("sbx-lb%d-%s", i, run)))
	}

	type sess struct{ id, sandbox string }
	var all []sess
	for i := range 8 {
		sandboxID := fmt.Sprintf("sbx-lb%d-%s", i%4, run)
		var resp *sessionv1.CreateSessionResponse
		require.Eventually(t, func() bool {
			resp, err = ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
				UserId: "u-e2e", OrgId: "o-e2e", SandboxId: sandboxID,
				Worktree:   &sessionv1.Worktree{Directory: fmt.Sprintf("/work/lb-%d", i)},
				Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
			})
			return err == nil
		}, 30*time.Second, 50*time.Millisecond)
		all = append(all, sess{id: resp.GetSession().GetSessionId(), sandbox: sandboxID})
	}
	for _, s := range all {
		_, err := ses.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: s.id, MessageId: "m1", Content: "hello"})
		require.NoError(t, err)
	}
	for _, s := range all {
		waitCompleted(t, ses, s.id, "m1", 90*time.Second)
	}
	owners := map[string]int{}
	for i := range 4 {
		owners[a.owner(fmt.Sprintf("sbx-lb%d-%s", i, run))]++
	}
	require.Equal(t, map[string]int{"replica-a": 2, "replica-b": 2}, owners, "each replica kept its sandboxes")

	// kill -9 the owner of sandbox 0: its sandboxes move to the survivor
	// and their sessions complete their next message.
	victim, survivor := a, b
	if a.owner(all[0].sandbox) == "replica-b" {
		victim, survivor = b, a
	}
	victim.kill9()
	killed := time.Now()
	require.Eventually(t, func() bool { return survivor.owner(all[0].sandbox) == survivor.name },
		30*time.Second, 20*time.Millisecond, "the sandbox moves to the survivor")
	t.Logf("sandbox moved %v after kill -9 (owner TTL %v)", time.Since(killed), replicaOwnerTTL)
	for _, s := range all {
		_, err := ses.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: s.id, MessageId: "m2", Content: "again"})
		require.NoError(t, err)
	}
	for _, s := range all {
		waitCompleted(t, ses, s.id, "m2", 90*time.Second)
	}
	for i := range 4 {
		require.Equal(t, survivor.name, survivor.owner(fmt.Sprintf("sbx-lb%d-%s", i, run)))
	}

	// Deletions complete: the session service releases each route at the
	// owner and sees its wrapper gone.
	suiteLike := &suite{ses: ses}
	for _, s := range all {
		suiteLike.deleteSession(t, s.id)
	}
	for _, s := range all {
		_, err := ses.GetSession(context.Background(), &sessionv1.GetSessionRequest{SessionId: s.id})
		require.Equal(t, codes.NotFound, status.Code(err), "session %s is gone", s.id)
	}
}
