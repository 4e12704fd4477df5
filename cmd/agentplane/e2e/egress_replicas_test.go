package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	"agentplane.dev/pkg/testaddr"
)

// sockets lists the sockets of one way out of the sandbox root (egress,
// proxy), sorted: the order in which a wrapper tries them.
func sockets(t *testing.T, root, way string) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(root, ".sockets", way))
	require.NoError(t, err)
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	slices.Sort(out)
	return out
}

// newSocket is the one socket of now that was not in before.
func newSocket(t *testing.T, before, now []string) string {
	t.Helper()
	var added []string
	for _, n := range now {
		if !slices.Contains(before, n) {
			added = append(added, n)
		}
	}
	require.Len(t, added, 1, "one new egress socket (before %v, now %v)", before, now)
	return added[0]
}

// egressReplicas is two sandbox replicas, separate processes sharing one
// sandbox root (so every wrapper sees both egress sockets), before
// sandbox-c, whose socket a wrapper tries second, took sandboxID over.
type egressReplicas struct {
	e         *egressSuite
	st        *stack
	a, c      *sandboxReplica
	sockA     []string
	sandboxID string
}

func startEgressReplicas(t *testing.T, name string, kv ...string) *egressReplicas {
	e := startEgressServers(t)
	st := newStack(t, stackOptions{logLevel: "info"})
	st.releaseListeners(svcSandbox)
	addrA, addrC := testaddr.Addr(t), testaddr.Addr(t)
	lb := startBalancer(t, addrA, addrC)
	st.set(svcSession, "SANDBOX_ADDR", lb.addr())
	st.runInProcess(nil, svcCredential, svcIngest, svcSession)
	e.suite = st.suite()

	// The names are chosen for their sockets' order (the checks below say
	// so): sandbox-a's sorts before sandbox-c's, and sandbox-c's restart,
	// sandbox-c-2, sorts before sandbox-a's.
	kv = append([]string{"SANDBOX_EGRESS_HOSTS", egressHosts}, kv...)
	a := st.startSandboxReplica("sandbox-a", addrA, lb.addr(), kv...)
	sockA := sockets(t, st.root, "egress")
	c := st.startSandboxReplica("sandbox-c", addrC, lb.addr(), kv...)
	sockC := newSocket(t, sockA, sockets(t, st.root, "egress"))
	require.Len(t, sockA, 1)
	require.Less(t, sockA[0], sockC, "sandbox-a's socket is tried first")
	require.Equal(t, []string{sockA[0], sockC}, sockets(t, st.root, "proxy"), "in proxy/ too")

	// sandbox-c owns the sandbox before the session exists (an Abort of an
	// unknown message makes the replica asked take it).
	sandboxID := name + "-" + st.run
	warm(t, c.client, sandboxID)
	require.Equal(t, c.name, c.owner(sandboxID))
	return &egressReplicas{e: e, st: st, a: a, c: c, sockA: sockA, sandboxID: sandboxID}
}

// TestEgressReachesTheOwnerAmongReplicas: two sandbox replicas, separate
// processes, share one sandbox root, so every wrapper sees both egress
// sockets, and only the replica that owns its sandbox can authenticate it.
// The sandbox is owned by the replica whose socket a wrapper tries second:
// curl inside the boundary still reaches the allowed server. Then the owner
// is killed (-9), the other replica takes the sandbox over, and the killed
// one comes back as a new replica whose socket now sorts first: the next
// connection reaches the allowed server too.
func TestEgressReachesTheOwnerAmongReplicas(t *testing.T) {
	r := startEgressReplicas(t, "egress-owner")
	e, st, a, c, sockA, sandboxID := r.e, r.st, r.a, r.c, r.sockA, r.sandboxID
	sess := e.createSession(t, sandboxID, "/repo/egress-owner")
	id := sess.GetSessionId()

	curl := []string{"curl", "-sS", "-m", "15"}
	code, out := e.runIn(t, id, "m1", append(curl, e.url("http", "allowed.test", e.httpPort))...)
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "egress-ok allowed.test:")
	require.Equal(t, c.name, a.owner(sandboxID), "the second socket's replica served it")
	// The credential proxy's relay is another matter: any replica's carries
	// the bytes to the proxy's address, so sandbox-a's (its socket sorts
	// first in proxy/ too) serves sandbox-c's runtime.
	requireProviderCall(t, e.suite, id, "m1-provider")

	// Failover: sandbox-a takes the sandbox over; sandbox-c comes back as
	// sandbox-c-2, whose socket sorts first and which owns nothing.
	c.kill9()
	require.Eventually(t, func() bool { return a.owner(sandboxID) == a.name }, 60*time.Second, 20*time.Millisecond,
		"the sandbox moves to sandbox-a")
	before := sockets(t, st.root, "egress")
	c.start()
	require.Eventually(t, func() bool { return serving(c.conn) }, 60*time.Second, 50*time.Millisecond, "sandbox-c-2 answers")
	socks := sockets(t, st.root, "egress")
	sockC2 := newSocket(t, before, socks)
	require.Equal(t, []string{sockC2, sockA[0]}, socks, "sandbox-c's stale socket is gone and sandbox-c-2's is tried first")
	require.Equal(t, a.name, a.owner(sandboxID))

	code, out = e.runIn(t, id, "m2", append(curl, "-k", e.url("https", "allowed.test", e.tPort))...)
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "egress-ok allowed.test:")
	require.Equal(t, a.name, a.owner(sandboxID))
	requireProviderCall(t, e.suite, id, "m2-provider")
}

// requireProviderCall has the scripted runtime call the provider through
// the credential proxy and requires the upstream's answer.
func requireProviderCall(t *testing.T, s *suite, sessionID, messageID string) {
	t.Helper()
	for _, ev := range s.turn(t, sessionID, messageID, "hello provider") {
		re := ev.GetRuntimeEvent()
		if re.GetToolName() == "provider" && re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT {
			require.EqualValues(t, 200, re.GetData().AsMap()["status"])
			return
		}
	}
	t.Fatalf("no provider call in %s", messageID)
}

// TestEgressByteWindowOutlivesItsOwner: the sandbox's egress byte window
// survives its owner's kill -9. Under sandbox-c, curl inside the boundary
// carries the sandbox's allowance (SANDBOX_EGRESS_MAX_BYTES) within a few
// requests, and the next are refused; sandbox-a takes the sandbox over,
// reads the window sandbox-c saved to the store, and refuses the next
// connection too, where a window kept only in the owner's memory would
// start over.
func TestEgressByteWindowOutlivesItsOwner(t *testing.T) {
	r := startEgressReplicas(t, "egress-window", "SANDBOX_EGRESS_MAX_BYTES", "1000")
	e, a, c := r.e, r.a, r.c
	id := e.createSession(t, r.sandboxID, "/repo/egress-window").GetSessionId()
	url := e.url("http", "allowed.test", e.httpPort)
	code, out := e.runIn(t, id, "m1", "curl", "-sS", "-m", "15", url, url, url, url, url, url, url, url)
	t.Logf("under sandbox-c: exit %d, %q", code, out)
	require.Contains(t, out, "egress-ok allowed.test:", "the first requests fit")
	require.Contains(t, out, "denied (bytes_limit)", "the allowance is carried within eight requests")

	c.kill9()
	require.Eventually(t, func() bool { return a.owner(r.sandboxID) == a.name }, 60*time.Second, 20*time.Millisecond,
		"the sandbox moves to sandbox-a")
	_, out = e.runIn(t, id, "m2", "curl", "-sS", "-m", "15", url)
	require.Contains(t, out, "denied (bytes_limit)", "sandbox-a goes on with sandbox-c's window")
	require.NotContains(t, out, "egress-ok")
	require.Equal(t, a.name, a.owner(r.sandboxID))
}
