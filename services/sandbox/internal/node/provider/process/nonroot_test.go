package process

import (
	"context"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/nodump"
	"agentplane.dev/pkg/testenv"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// chartUID is the uid the Helm chart runs the sandbox service as
// (podSecurityContext.runAsUser).
const chartUID = 65532

// The process provider as the chart runs it: a non-root uid without
// capabilities, its sandbox root its own, and (like every service)
// non-dumpable. Sandbox A runs a non-dumpable runtime (its /proc files then
// belong to a root its user namespace does not map, unreadable to the
// service) while sandbox B is launched: both are discovered, and both are
// stopped with verified absence, every process of A included. It runs
// twice: with the service dumpable (only A's runtime hides), then
// non-dumpable (the service's own /proc files are root's too).
//
// Run as root (CI), the test re-executes a copy of its binary as chartUID.
func TestNonRootServiceDiscoversAndStops(t *testing.T) {
	if os.Geteuid() == 0 {
		asUID(t, chartUID, "^TestNonRootServiceDiscoversAndStops$")
		return
	}
	for _, name := range []string{"service dumpable", "service non-dumpable"} {
		t.Run(name, func(t *testing.T) {
			if name == "service non-dumpable" {
				require.NoError(t, nodump.Set())
				_, err := os.ReadFile("/proc/self/environ")
				require.Error(t, err, "a non-dumpable non-root process cannot read its own environ")
			}
			nonDumpableNeighbour(t)
		})
	}
}

func nonDumpableNeighbour(t *testing.T) {
	p := newProvider(t)
	ctx := context.Background()
	sbA := sandboxID(t, p)
	a := launch(t, p, sbA, "k", "ia", "nodump", "/w/a")
	// Should discovery fail, the sandboxes' cleanup cannot stop them: kill
	// their bubblewraps (their namespaces go with them) so p.Wait returns.
	t.Cleanup(func() { _ = syscall.Kill(a.PID, syscall.SIGKILL) })
	ns := nsOf(t, a.PID)
	require.Eventually(t, func() bool { return len(inNS(ns)) >= 3 }, 10*time.Second, 10*time.Millisecond, "init, the helper, its sleep")
	for _, pid := range inNS(ns) {
		if cmd, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); len(cmd) > 0 && string(cmd[:len(cmd)-1]) == os.Args[0] {
			_, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
			require.ErrorIs(t, err, os.ErrPermission, "A's runtime hid its environ from the service")
		}
	}
	sbB := sbA + "b"
	t.Cleanup(func() { p.Stop(context.Background(), provider.StopTarget{SandboxID: sbB, RuntimeKey: "k"}) })
	b := launch(t, p, sbB, "k", "ib", "sleep", "/w/b")
	t.Cleanup(func() { _ = syscall.Kill(b.PID, syscall.SIGKILL) })

	for sb, o := range map[string]provider.Observed{sbA: a, sbB: b} {
		d := p.Discover(ctx, sb, "k")
		require.Equal(t, provider.Present, d.Kind, "%s: %v", sb, d.Err)
		require.Len(t, d.Observed, 1)
		require.Equal(t, o.PID, d.Observed[0].PID)
		require.Equal(t, o.InstanceID, d.Observed[0].InstanceID)
		live, err := p.LiveWorkspaces(ctx, sb)
		require.NoError(t, err)
		require.True(t, live[o.Workspace])
	}
	snap := snapshot(t, append(inNS(ns), a.PID))
	res := p.Stop(ctx, provider.StopTarget{SandboxID: sbA, RuntimeKey: "k"})
	require.Equal(t, provider.StopAbsent, res.Kind, "%v", res.Err)
	require.Empty(t, leftOf(snap), "absence of A is verified only when none of its processes remains")
	require.True(t, alive(b.PID))
	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sbB, RuntimeKey: "k"}).Kind)
	require.False(t, alive(b.PID))
	p.Wait()
}

// asUID runs the test named by run in a copy of this test binary as uid.
func asUID(t *testing.T, uid int, run string) {
	t.Helper()
	testenv.AsUID(t, uid, run, "AGENTPLANE_SANDBOX_BWRAP="+os.Getenv("AGENTPLANE_SANDBOX_BWRAP"))
}
