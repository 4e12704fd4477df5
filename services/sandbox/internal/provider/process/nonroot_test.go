package process

import (
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/nodump"
	"agentplane.dev/services/sandbox/internal/provider"
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

// asUID runs the test named by run in a copy of this test binary as uid
// (and gid) without capabilities, and fails with its output if it fails.
// The copy lives in a directory the uid can reach (go test builds into one
// only root can enter).
func asUID(t *testing.T, uid int, run string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "asuid-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	bin := filepath.Join(dir, filepath.Base(os.Args[0]))
	src, err := os.Open(os.Args[0])
	require.NoError(t, err)
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(dst, src)
	require.NoError(t, err)
	require.NoError(t, src.Close())
	require.NoError(t, dst.Close())
	cmd := exec.Command(bin, "-test.run", run, "-test.count=1", "-test.v", "-test.timeout=5m")
	cmd.Dir = dir
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "TMPDIR=/tmp", "AGENTPLANE_SANDBOX_BWRAP=" + os.Getenv("AGENTPLANE_SANDBOX_BWRAP")}
	if os.Getenv("CI") != "" {
		cmd.Env = append(cmd.Env, "CI="+os.Getenv("CI"))
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), Groups: []uint32{}}}
	out, err := cmd.CombinedOutput()
	t.Logf("as uid %d:\n%s", uid, out)
	require.NoError(t, err, "the test failed as uid %d", uid)
}
