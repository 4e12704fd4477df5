package cgroup

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/testenv"
)

// The test binary doubles as the hog run inside a group: it waits for a
// line on stdin (so it is in the group before it does anything), then
// touches MiB of memory or spins on every core for a while.
func TestMain(m *testing.M) {
	switch os.Getenv("CGROUP_HOG") {
	case "":
		os.Exit(m.Run())
	case "memory":
		_, _ = os.Stdin.Read(make([]byte, 1))
		n, _ := strconv.Atoi(os.Getenv("CGROUP_HOG_MIB"))
		var keep [][]byte
		for range n {
			b := make([]byte, 1<<20)
			for i := range b {
				b[i] = 1
			}
			keep = append(keep, b)
		}
		fmt.Println(len(keep))
		os.Exit(0)
	case "cpu":
		_, _ = os.Stdin.Read(make([]byte, 1))
		deadline := time.Now().Add(time.Second)
		done := make(chan struct{})
		for range 4 {
			go func() {
				for time.Now().Before(deadline) {
				}
				done <- struct{}{}
			}()
		}
		for range 4 {
			<-done
		}
		os.Exit(0)
	}
}

func managerOrFail(t *testing.T) *Manager {
	t.Helper()
	m, why := Detect("/sys/fs/cgroup")
	if m == nil {
		testenv.Missing(t, "cgroup limits: %s", why)
	}
	return m
}

// hog runs the test binary as hog kind inside g and returns how it ended.
func hog(t *testing.T, g *Group, kind string, env ...string) error {
	t.Helper()
	return startHog(t, g, kind, env...).Wait()
}

// startHog starts the test binary as hog kind inside g.
func startHog(t *testing.T, g *Group, kind string, env ...string) *exec.Cmd {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(self)
	cmd.Env = append([]string{"CGROUP_HOG=" + kind}, env...)
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	require.NoError(t, g.Add(cmd.Process.Pid))
	_, _ = in.Write([]byte("\n"))
	return cmd
}

var groups int

func newGroup(t *testing.T, m *Manager, l Limits) *Group {
	t.Helper()
	groups++
	name := fmt.Sprintf("test-%d-%d", os.Getpid(), groups)
	g, err := m.Create(name, l)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, g.Remove()) })
	return g
}

// TestMemoryHogIsHeldAndCounted: a process past the group's memory limit
// never gets the memory; the group counts the event (what the service
// turns into the memory_limit reason) and the hog is stopped by SIGKILL.
func TestMemoryHogIsHeldAndCounted(t *testing.T) {
	m := managerOrFail(t)
	g := newGroup(t, m, Limits{MemoryBytes: 64 << 20, Pids: 64})
	cmd := startHog(t, g, "memory", "CGROUP_HOG_MIB=256")
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	require.Eventually(t, func() bool {
		n, err := g.MemoryEvents()
		return err == nil && n > 0
	}, 60*time.Second, 20*time.Millisecond, "the group reports the limit reached")
	require.NoError(t, g.Kill())
	err := <-done
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "the hog must not finish")
	require.Equal(t, syscall.SIGKILL, ee.Sys().(syscall.WaitStatus).Signal())
	require.Eventually(t, g.Empty, 30*time.Second, 20*time.Millisecond)

	// Within the limit nothing is counted.
	g2 := newGroup(t, m, Limits{MemoryBytes: 256 << 20})
	require.NoError(t, hog(t, g2, "memory", "CGROUP_HOG_MIB=16"))
	n, err := g2.MemoryEvents()
	require.NoError(t, err)
	require.Zero(t, n)
}

// TestCPUHogIsThrottled: four busy threads in a group of 1 % of a core
// are throttled by the CFS quota (counted by the kernel, no clock read).
func TestCPUHogIsThrottled(t *testing.T) {
	m := managerOrFail(t)
	g := newGroup(t, m, Limits{CPUMillis: 10})
	require.NoError(t, hog(t, g, "cpu"))
	stat := "cpu.stat"
	dir := g.dirs[0]
	if g.version == V1 {
		dir = g.dirs[1]
	}
	b, err := os.ReadFile(filepath.Join(dir, stat))
	require.NoError(t, err)
	throttled := -1
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "nr_throttled "); ok {
			throttled, _ = strconv.Atoi(v)
		}
	}
	require.Positive(t, throttled, "%s", b)
}

// TestPidsLimit: a group's processes cannot pass pids.max.
func TestPidsLimit(t *testing.T) {
	m := managerOrFail(t)
	g := newGroup(t, m, Limits{Pids: 4})
	cmd := exec.Command("sh", "-c", "read x; for i in 1 2 3 4 5 6 7 8; do sleep 1 & done; wait")
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	var out strings.Builder
	cmd.Stderr = &out
	require.NoError(t, cmd.Start())
	require.NoError(t, g.Add(cmd.Process.Pid))
	_, _ = in.Write([]byte("\n"))
	_ = cmd.Wait()
	require.Contains(t, out.String(), "fork", "sh could not start more than pids.max: %s", out.String())
	require.Eventually(t, g.Empty, 30*time.Second, 50*time.Millisecond, "the sleeps that started end")
}

// TestDetectedManagerCanCreate: what Detect answers holds for a launch: a
// Manager it returns makes, limits and removes a group; otherwise it says
// why not. Run as root, then as the chart's uid 65532 after root made the
// parents (as in CI, where root services ran first on the same host): the
// non-root service finds the parents there but cannot write below them,
// and before the probe Detect answered a Manager whose every Create failed
// (the chart-shaped session never launched: e2e TestChartShapedSession).
func TestDetectedManagerCanCreate(t *testing.T) {
	m, why := Detect("/sys/fs/cgroup")
	if os.Getenv("CGROUP_AS_NON_ROOT") == "" {
		if os.Geteuid() != 0 {
			testenv.Missing(t, "root, to make the parents first and re-execute as 65532")
		}
		if m == nil {
			testenv.Missing(t, "cgroup limits as root: %s", why)
		}
		testenv.AsUID(t, 65532, "^TestDetectedManagerCanCreate$", "CGROUP_AS_NON_ROOT=1")
	}
	if m == nil {
		require.NotEmpty(t, why)
		t.Logf("uid %d: cgroup limits unavailable: %s", os.Geteuid(), why)
		return
	}
	g, err := m.Create(fmt.Sprintf("test-detect-%d", os.Getpid()), DefaultLimits)
	require.NoError(t, err, "uid %d: Detect answered a Manager that cannot create a group", os.Geteuid())
	require.NoError(t, g.Remove())
}
