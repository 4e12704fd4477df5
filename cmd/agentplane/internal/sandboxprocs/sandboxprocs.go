// Package sandboxprocs finds and stops the processes that run under a
// process-provider sandbox root. By design a wrapper outlives its sandbox
// service (it reconnects for the reconnect window), so whoever owns the root
// itself — `agentplane dev`, which deletes its temporary root on exit, and the
// end-to-end tests — must stop what still runs there.
package sandboxprocs

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Under lists the live processes whose working directory is under root: the
// wrappers (their workspace is under the sandbox root) and the runtimes they
// started there. Zombies are left out: only their exit status remains.
func Under(root string) []int {
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
			continue
		}
		pids = append(pids, pid)
	}
	return pids
}

// Stop sends SIGTERM to every process under root and its process group,
// SIGKILL to what is left after grace, and returns what still runs after
// bound (empty when everything is gone).
func Stop(root string, grace, bound time.Duration) []int {
	signal := func(sig syscall.Signal) []int {
		pids := Under(root)
		for _, pid := range pids {
			_ = syscall.Kill(-pid, sig) // its process group: the runtime's children
			_ = syscall.Kill(pid, sig)
		}
		return pids
	}
	if len(signal(syscall.SIGTERM)) == 0 {
		return nil
	}
	deadline := time.Now().Add(bound)
	killAt := time.Now().Add(grace)
	for {
		time.Sleep(50 * time.Millisecond)
		sig := syscall.SIGTERM
		if time.Now().After(killAt) {
			sig = syscall.SIGKILL
		}
		left := signal(sig)
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
	}
}
