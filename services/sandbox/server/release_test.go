package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/server"
)

// Issue 18 item 8 (process level): ReleaseRoute for a session whose route
// record is missing or does not parse fails closed. While the session's
// wrapper runs it is not verified absent; the release stops the wrapper, and
// absence is reported only once no process of the runtime key is left.
func TestReleaseWithoutARouteRecordFailsClosed(t *testing.T) {
	for name, corrupt := range map[string]func(ctx context.Context, sb string) error{
		"unparsable": func(ctx context.Context, sb string) error {
			return redisSrv.Client(t).HSet(ctx, store.Key(sb, "routes"), "s1", "{not json").Err()
		},
		"missing": func(ctx context.Context, sb string) error {
			return redisSrv.Client(t).HDel(ctx, store.Key(sb, "routes"), "s1").Err()
		},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			n := startNotify(t)
			first, stopFirst := startStoppableService(t, ctx, n.addr, nil)
			sb := uniqueSandbox(t)
			waitReady(t, first, n, 0, route(sb, "s1", "/repo/"+name))
			require.Len(t, wrappersOf(t, sb), 1)

			// The replica stops (releasing the sandbox; the wrapper lives on
			// and reconnects); the route record is lost meanwhile.
			stopFirst()
			require.NoError(t, corrupt(ctx, sb))
			// The replica that takes over shares the node's sandbox root
			// (discovery only sees its own root's wrappers, issue 16).
			second := startService(t, n.addr, func(c *server.Config) { c.SandboxRoot = first.root })

			rel, err := second.client.ReleaseRoute(ctx, &sandboxv1.ReleaseRouteRequest{Tenant: testTenant, SandboxId: sb, SessionId: "s1", Reason: "session-delete"})
			require.NoError(t, err)
			if rel.GetAbsenceVerified() {
				require.Empty(t, pidsOf(wrappersOf(t, sb)), "absence verified while the session's wrapper runs")
			}
			require.Eventually(t, func() bool {
				rel, err = second.client.ReleaseRoute(ctx, &sandboxv1.ReleaseRouteRequest{Tenant: testTenant, SandboxId: sb, SessionId: "s1", Reason: "session-delete"})
				require.NoError(t, err)
				return rel.GetAbsenceVerified()
			}, 60*time.Second, 100*time.Millisecond, "the release stops the wrapper and then verifies absence")
			require.Empty(t, pidsOf(wrappersOf(t, sb)), "absence verified only once no process is left")
			require.Equal(t, sandboxv1.LeaseState_LEASE_STATE_NONE, rel.GetLeaseState())
		})
	}
}

func pidsOf(ps []proc) []int {
	out := make([]int, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.PID)
	}
	return out
}
