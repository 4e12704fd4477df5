package server_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/node/provider/process"
	"agentplane.dev/services/sandbox/server"
)

// Under the worktree contract two sessions of one directory share one
// wrapper and one runtime process; a turn produces events and one outcome.
func TestWorktreeSessionsShareOneRuntime(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, nil)
	sb := uniqueSandbox(t)

	r1, _ := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/a"))
	r2, _ := waitReady(t, svc, n, 0, route(sb, "s2", "/repo/a"))
	require.Equal(t, r1.Instance, r2.Instance, "both routes on one wrapper")
	require.NotEqual(t, r1.RuntimeSessionID, r2.RuntimeSessionID)

	ws := wrappersOf(t, sb)
	require.Len(t, ws, 1)
	require.Len(t, runtimesOf(t, instancesOf(ws)), 1, "one runtime process for the directory")

	sc, err := svc.client.GetScope(context.Background(), &sandboxv1.GetScopeRequest{Tenant: testTenant, SandboxId: sb, Directory: "/repo/a"})
	require.NoError(t, err)
	require.Equal(t, sandboxv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE, sc.GetScope().GetContract())
	require.Len(t, sc.GetScope().GetMembers(), 2)

	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m1", "hello there"))
	out, _ := n.wait(t, 0, "outcome", "s1")
	require.Equal(t, "TURN_RESULT_SUCCEEDED", out.Reason)
	require.Equal(t, "m1", out.Text)
	_, _, ok := n.find(0, "event:RUNTIME_EVENT_KIND_TOOL_CALL", "s1")
	require.True(t, ok)
	_, _, ok = n.find(0, "event:RUNTIME_EVENT_KIND_MESSAGE", "s1")
	require.True(t, ok)

	// Prepare is idempotent: a ready route stays ready with the same wrapper.
	p, err := svc.client.Prepare(context.Background(), route(sb, "s1", "/repo/a"))
	require.NoError(t, err)
	require.Equal(t, sandboxv1.RouteState_ROUTE_STATE_READY, p.GetRoute().GetState())
	require.Equal(t, r1.Instance, p.GetRoute().GetWrapperInstance())

	// Releasing one member keeps the runtime; releasing the last stops it.
	rel, err := svc.client.ReleaseRoute(context.Background(), &sandboxv1.ReleaseRouteRequest{Tenant: testTenant, SandboxId: sb, SessionId: "s1", Reason: "session-delete"})
	require.NoError(t, err)
	require.False(t, rel.GetLastMember())
	require.True(t, rel.GetAbsenceVerified())
	wsDir := filepath.Join(svc.root, sb, "workspaces", process.WorkspaceName("/repo/a"))
	require.DirExists(t, wsDir, "the directory's other session keeps its workspace")
	require.NoError(t, os.WriteFile(filepath.Join(wsDir, "left-by-s1.txt"), []byte("x"), 0o644))
	logs, _ := filepath.Glob(filepath.Join(svc.root, sb, "logs", "*.log"))
	require.NotEmpty(t, logs)
	require.Eventually(t, func() bool {
		rel, err = svc.client.ReleaseRoute(context.Background(), &sandboxv1.ReleaseRouteRequest{Tenant: testTenant, SandboxId: sb, SessionId: "s2", Reason: "session-delete"})
		require.NoError(t, err)
		require.True(t, rel.GetLastMember())
		return rel.GetAbsenceVerified()
	}, 60*time.Second, 200*time.Millisecond)
	require.Empty(t, wrappersOf(t, sb))
	// Issue 32: the last session's verified release took the directory's
	// workspace, home and wrapper logs with it.
	require.NoDirExists(t, wsDir)
	require.NoDirExists(t, filepath.Join(svc.root, sb, "homes", process.WorkspaceName("/repo/a")))
	logs, _ = filepath.Glob(filepath.Join(svc.root, sb, "logs", "*.log"))
	require.Empty(t, logs)
}

// Under per_session (a wrapper without the worktree capability) each session
// of a directory gets its own wrapper and runtime.
func TestPerSessionSessionsGetOwnRuntimes(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, func(c *server.Config) {
		c.WrapperCommand = []string{binPath, "wrapper", "--capabilities="}
	})
	sb := uniqueSandbox(t)

	r1, _ := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/b"))
	r2, _ := waitReady(t, svc, n, 0, route(sb, "s2", "/repo/b"))
	require.NotEqual(t, r1.Instance, r2.Instance)

	require.Eventually(t, func() bool { return len(wrappersOf(t, sb)) == 2 }, 30*time.Second, 50*time.Millisecond,
		"the probe wrapper keyed by directory is gone, one wrapper per session remains")
	ws := wrappersOf(t, sb)
	keys := map[string]bool{}
	for _, w := range ws {
		keys[w.Env["AGENTPLANE_RUNTIME_KEY"]] = true
	}
	require.Equal(t, map[string]bool{"s1": true, "s2": true}, keys)
	require.Eventually(t, func() bool { return len(runtimesOf(t, instancesOf(wrappersOf(t, sb)))) == 2 }, 30*time.Second, 50*time.Millisecond)

	sc, err := svc.client.GetScope(context.Background(), &sandboxv1.GetScopeRequest{Tenant: testTenant, SandboxId: sb, Directory: "/repo/b"})
	require.NoError(t, err)
	require.Equal(t, sandboxv1.RuntimeContract_RUNTIME_CONTRACT_PER_SESSION, sc.GetScope().GetContract())
}
