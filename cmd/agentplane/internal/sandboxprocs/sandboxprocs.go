// Package sandboxprocs finds and stops the processes that run under a
// process-provider sandbox root. By design a wrapper outlives its sandbox
// service (it reconnects for the reconnect window), so whoever owns the root
// itself — `agentplane dev`, which deletes its temporary root on exit, and the
// end-to-end tests — must stop what still runs there.
package sandboxprocs

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Proc is a live process as the host's /proc shows it.
type Proc struct {
	PID, PPID int
	Exe       string   // its executable ("" when unreadable)
	Env       []string // its environment, KEY=value (nil when unreadable)
}

// Has reports whether its environment holds kv ("KEY=value").
func (p Proc) Has(kv string) bool { return slices.Contains(p.Env, kv) }

// Value is key's value in its environment.
func (p Proc) Value(key string) (string, bool) {
	for _, kv := range p.Env {
		if v, ok := strings.CutPrefix(kv, key+"="); ok {
			return v, true
		}
	}
	return "", false
}

// Live lists the live processes. Zombies are left out: only their exit
// status remains.
func Live() ([]Proc, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []Proc
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// stat is "pid (comm) state ppid ...": comm may hold spaces and parentheses.
		rest := string(stat)
		if i := strings.LastIndexByte(rest, ')'); i >= 0 {
			rest = rest[i+1:]
		}
		f := strings.Fields(rest)
		if len(f) < 2 || f[0] == "Z" {
			continue
		}
		p := Proc{PID: pid}
		p.PPID, _ = strconv.Atoi(f[1])
		p.Exe, _ = os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
		if env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ")); err == nil {
			p.Env = strings.Split(strings.TrimSuffix(string(env), "\x00"), "\x00")
		}
		out = append(out, p)
	}
	return out, nil
}

// Under lists the live processes whose working directory is under root
// (each wrapper's bubblewrap: its workspace is under the sandbox root) and
// their descendants: the wrappers and runtimes inside, whose working
// directory, read from the host, is the session's directory inside their
// own mount namespace, not a path under root.
func Under(root string) []int {
	procs, _ := Live()
	children := map[int][]int{}
	live := map[int]bool{}
	var queue []int
	for _, p := range procs {
		live[p.PID] = true
		children[p.PPID] = append(children[p.PPID], p.PID)
		if cwd, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(p.PID), "cwd")); err == nil && strings.HasPrefix(cwd, root+string(filepath.Separator)) {
			queue = append(queue, p.PID)
		}
	}
	seen := map[int]bool{}
	var pids []int
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		if seen[pid] || !live[pid] {
			continue
		}
		seen[pid] = true
		pids = append(pids, pid)
		queue = append(queue, children[pid]...)
	}
	slices.Sort(pids)
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
