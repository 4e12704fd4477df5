package process

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// The decision of the sampled memory limit: each passing is reported once,
// again only after the key was under or gone; a gone key or sandbox is
// forgotten; limit 0 never reports.
func TestMemWatchDecides(t *testing.T) {
	const limit = 100
	var w memWatch
	steps := []struct {
		name    string
		sandbox string
		usage   map[string]uint64
		limit   uint64
		want    []string
	}{
		{"under", "a", map[string]uint64{"k1": 50, "k2": 100}, limit, nil},
		{"k1 over", "a", map[string]uint64{"k1": 101, "k2": 100}, limit, []string{"k1"}},
		{"k1 still over: reported already", "a", map[string]uint64{"k1": 500, "k2": 10}, limit, nil},
		{"both over: only k2 is new", "a", map[string]uint64{"k1": 500, "k2": 200}, limit, []string{"k2"}},
		{"another sandbox is its own", "b", map[string]uint64{"k1": 101}, limit, []string{"k1"}},
		{"k1 under again, k2 gone", "a", map[string]uint64{"k1": 1}, limit, nil},
		{"k1 and k2 over again: new passings", "a", map[string]uint64{"k1": 101, "k2": 101}, limit, []string{"k1", "k2"}},
		{"no limit", "c", map[string]uint64{"k1": 1 << 40}, 0, nil},
	}
	for _, s := range steps {
		require.Equal(t, s.want, w.observe(s.sandbox, s.usage, s.limit), s.name)
	}
	w.retain(map[string]bool{"a": true})
	require.Nil(t, w.reported["b"], "a sandbox no longer live is forgotten")
	require.Equal(t, []string{"k1"}, w.observe("b", map[string]uint64{"k1": 101}, limit), "so its next passing is new")
	require.Nil(t, w.observe("a", map[string]uint64{"k1": 101, "k2": 101}, limit), "a live sandbox kept its state")
}

// procMemory reads Pss where smaps_rollup is readable, else RssAnon +
// RssShmem of status, else statm's resident less shared pages.
func TestProcMemoryFallbacks(t *testing.T) {
	root := t.TempDir()
	write := func(pid int, name, body string) {
		dir := filepath.Join(root, strconv.Itoa(pid))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
	write(1, "smaps_rollup", "00400000-7fff [rollup]\nRss:    9000 kB\nPss:    3000 kB\n")
	write(1, "status", "Name: x\nRssAnon:\t 1 kB\n")
	write(2, "status", "Name: x\nVmRSS:\t 9000 kB\nRssAnon:\t 2048 kB\nRssFile:\t 6000 kB\nRssShmem:\t 1024 kB\n")
	write(3, "statm", "100 50 20 1 0 30 0\n")
	write(4, "status", "Name: x\n")
	require.Equal(t, uint64(3000<<10), procMemory(root, 1))
	require.Equal(t, uint64(3072<<10), procMemory(root, 2))
	require.Equal(t, uint64(30*os.Getpagesize()), procMemory(root, 3))
	require.Zero(t, procMemory(root, 4))
	require.Zero(t, procMemory(root, 5), "gone")
}

// The host shape "neither", as the chart runs the service (uid 65532, no
// cgroups): a runtime holding 256 MiB in sandbox A passes a 64 MiB limit
// and is reported memory_limit once; sandbox B's sleeping runtime is not.
// Every process of both sandboxes runs SCHED_BATCH at the configured nice
// value, set before anything of the sandbox ran.
func TestSampledMemoryLimitAndWeight(t *testing.T) {
	if os.Geteuid() == 0 {
		asUID(t, chartUID, "^TestSampledMemoryLimitAndWeight$")
		return
	}
	p, err := New(Config{Root: t.TempDir(), Isolation: isolation(t), MemoryLimit: 64 << 20, Nice: 10})
	require.NoError(t, err)
	sbA := sandboxID(t, p)
	a := launch(t, p, sbA, "k", "ia", "hog", "/w/a")
	t.Cleanup(func() { _ = syscall.Kill(a.PID, syscall.SIGKILL) })
	sbB := sbA + "0"
	b := launch(t, p, sbB, "k", "ib", "sleep", "/w/b")
	t.Cleanup(func() { _ = syscall.Kill(b.PID, syscall.SIGKILL) })

	var got []provider.Breach
	require.Eventually(t, func() bool { got = append(got, p.OverLimit()...); return len(got) > 0 }, 20*time.Second, 50*time.Millisecond)
	got = append(got, p.OverLimit()...)
	require.Equal(t, []provider.Breach{{SandboxID: sbA, RuntimeKey: "k", Reason: provider.ReasonMemoryLimit}}, got)

	for _, o := range []provider.Observed{a, b} {
		pids := append(inNS(nsOf(t, o.PID)), o.PID)
		require.GreaterOrEqual(t, len(pids), 3, "bubblewrap, init, the runtime")
		for _, pid := range pids {
			nice, policy := schedOf(t, pid)
			require.Equal(t, 10, nice, "pid %d", pid)
			require.Equal(t, 3, policy, "pid %d: SCHED_BATCH", pid)
		}
	}
	// One Stop may find the hog still exiting (its processes run at nice 10,
	// SCHED_BATCH, and free 256 MiB) and say StillPresent, which its callers
	// retry; the key is stopped once one says absent.
	require.Eventually(t, func() bool {
		return p.Stop(context.Background(), provider.StopTarget{SandboxID: sbA, RuntimeKey: "k"}).Kind == provider.StopAbsent
	}, time.Minute, 10*time.Millisecond, "the key's processes never went")
	require.Empty(t, p.OverLimit(), "a stopped key is gone, not over")
}

// schedOf reads a process's nice value and scheduling policy from stat
// (fields 19 and 41).
func schedOf(t *testing.T, pid int) (int, int) {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	require.NoError(t, err)
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	nice, err := strconv.Atoi(f[16])
	require.NoError(t, err)
	policy, err := strconv.Atoi(f[38])
	require.NoError(t, err)
	return nice, policy
}
