package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// processesUnder lists the live processes whose working directory is under
// root: the wrappers the suite's sandbox service launched (their workspace
// is under the sandbox root) and the runtimes they started there.
func processesUnder(root string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cwd, err := os.Readlink(filepath.Join("/proc", e.Name(), "cwd"))
		if err != nil || !strings.HasPrefix(cwd, root+string(filepath.Separator)) {
			continue
		}
		if stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && strings.Contains(string(stat), ") Z ") {
			continue // exited; only its exit status is left
		}
		pids = append(pids, pid)
	}
	return pids
}

// killProcessesUnder registers a cleanup that kills every process still
// running under root and waits until none is left. By design a wrapper
// outlives its sandbox service (it reconnects for the reconnect window), so
// a test that stops the services must stop the wrappers itself: a wrapper
// left behind keeps running after the test and, since discovery reads
// /proc, the next suite that uses the same sandbox id sees it as a leaked
// wrapper of its own runtime key and stops that key.
//
// Register it before the services start: cleanups run last-in first-out,
// so it runs after the services stopped and cannot relaunch anything.
func killProcessesUnder(t testing.TB, root string) {
	t.Cleanup(func() {
		require.Eventually(t, func() bool {
			pids := processesUnder(root)
			for _, pid := range pids {
				_ = syscall.Kill(-pid, syscall.SIGKILL) // its process group (runtime children)
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			return len(pids) == 0
		}, 30*time.Second, 50*time.Millisecond, "processes under %s survived SIGKILL", root)
	})
}
