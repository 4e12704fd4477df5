// Package cgroup puts each sandbox in its own cgroup with memory, CPU and
// process limits (DESIGN.md 3.3 "Limits per sandbox"): cgroup v2 where the
// service's cgroup delegates the memory, pids and cpu controllers, cgroup
// v1 where the service may create groups in the memory, cpu and pids
// hierarchies (as root). Elsewhere Detect says why not, and start-up
// reports it.
package cgroup

import (
	"bufio"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Limits are one sandbox's cgroup limits; 0 leaves one unset.
type Limits struct {
	MemoryBytes uint64 // memory.limit_in_bytes (v1), memory.max (v2); over it the kernel's OOM killer acts inside the group
	CPUMillis   uint64 // CPU time per second, in thousandths of a core (1000: one core)
	Pids        uint64 // pids.max: processes and threads
}

// DefaultLimits fit 50 active agents on a 2-core 24 GiB node: a runtime
// with its tools rarely passes a few hundred MiB, so 1 GiB each holds any
// one sandbox while 50 typical ones fit; one core at most each, so no
// sandbox takes a node's both cores; pids as the rlimit's nproc.
var DefaultLimits = Limits{MemoryBytes: 1 << 30, CPUMillis: 1000, Pids: 512}

// cpuPeriod is the CFS period the CPU quota is a share of (µs).
const cpuPeriod = 100000

// Version is the cgroup interface a Manager writes.
type Version int

const (
	V1 Version = 1
	V2 Version = 2
)

// Manager creates the sandboxes' groups under one parent per hierarchy.
type Manager struct {
	version Version
	parents []string // v1: memory, cpu, pids parents; v2: the one parent
}

// sub is the directory the sandboxes' groups live in, under the service's
// own group.
const sub = "agentplane-sandboxes"

var v1Controllers = []string{"memory", "cpu", "pids"}

// Detect finds where this service may create sandbox groups under root
// (/sys/fs/cgroup), according to its own membership (/proc/self/cgroup):
// a Manager, or nil and why not.
func Detect(root string) (*Manager, string) {
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, "cannot read /proc/self/cgroup: " + err.Error()
	}
	own := parseSelf(string(self))
	var m *Manager
	var why string
	if ctl, err := os.ReadFile(filepath.Join(root, "cgroup.controllers")); err == nil {
		m, why = detectV2(root, own[""], string(ctl))
	} else {
		m, why = detectV1(root, own)
	}
	if m == nil {
		return nil, why
	}
	if err := m.probe(); err != nil {
		return nil, err.Error()
	}
	return m, ""
}

// detectV1 needs the memory, cpu and pids hierarchies and the service's
// parent group in each (made when missing).
func detectV1(root string, own map[string]string) (*Manager, string) {
	m := &Manager{version: V1}
	for _, c := range v1Controllers {
		mount := filepath.Join(root, c)
		if _, err := os.Stat(filepath.Join(mount, "cgroup.procs")); err != nil {
			return nil, fmt.Sprintf("cgroup v1 without the %s hierarchy at %s", c, mount)
		}
		parent := filepath.Join(mount, own[c], sub)
		if err := os.MkdirAll(parent, 0o755); err != nil {
			return nil, fmt.Sprintf("cgroup v1: cannot create %s (%v): the service needs root to limit sandboxes by cgroup", parent, err)
		}
		if c == "memory" {
			_ = os.WriteFile(filepath.Join(parent, "memory.use_hierarchy"), []byte("1"), 0) // so the parent's limit holds its children too
		}
		m.parents = append(m.parents, parent)
	}
	return m, ""
}

// detectV2 needs the service's group to delegate memory, pids and cpu: its
// cgroup.subtree_control must be writable. The service moves itself into a
// leaf first (no internal processes: a v2 group with processes cannot hand
// controllers to children).
func detectV2(root, own, available string) (*Manager, string) {
	for _, c := range v1Controllers {
		if !strings.Contains(" "+strings.TrimSpace(available)+" ", " "+c+" ") {
			return nil, fmt.Sprintf("cgroup v2 without the %s controller: not delegated to this service", c)
		}
	}
	base := filepath.Join(root, own)
	parent := filepath.Join(base, sub)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return nil, fmt.Sprintf("cgroup v2: cannot create %s (%v): the service's cgroup is not delegated to it", parent, err)
	}
	leaf := filepath.Join(base, "service")
	if err := os.MkdirAll(leaf, 0o755); err == nil {
		_ = os.WriteFile(filepath.Join(leaf, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0)
	}
	for _, dir := range []string{base, parent} {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+memory +pids +cpu"), 0); err != nil {
			return nil, fmt.Sprintf("cgroup v2: cannot enable memory, pids and cpu in %s: %v", dir, err)
		}
	}
	return &Manager{version: V2, parents: []string{parent}}, ""
}

// probe makes, limits and removes a group the way a launch does: a parent
// that exists is no proof that this service may make groups in it (a root
// service made it earlier; the chart's non-root service finds it there and
// cannot write below it). Where the probe fails, no launch would succeed, so
// the limits are reported unavailable at start-up instead of failing
// every launch (DESIGN.md 3.3 "Limits per sandbox": "a limit the host
// cannot enforce is reported at start-up").
func (m *Manager) probe() error {
	// Random: replicas in PID namespaces of their own may share a pid
	// (and, as root, a parent).
	var r [6]byte
	_, _ = rand.Read(r[:])
	name := fmt.Sprintf("probe-%d-%x", os.Getpid(), r)
	g, err := m.Create(name, Limits{MemoryBytes: DefaultLimits.MemoryBytes, CPUMillis: DefaultLimits.CPUMillis, Pids: DefaultLimits.Pids})
	if err != nil {
		return fmt.Errorf("cgroup v%d: cannot make a sandbox group under %s: %w", m.version, m.parents[0], err)
	}
	defer func() { _ = g.Remove() }()
	for _, d := range g.dirs {
		if err := unix.Access(filepath.Join(d, "cgroup.procs"), unix.W_OK); err != nil {
			return fmt.Errorf("cgroup v%d: cannot move processes into %s: %w", m.version, d, err)
		}
	}
	return nil
}

// parseSelf maps each v1 controller (and "" for v2) to the service's group.
func parseSelf(s string) map[string]string {
	out := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[1] == "" {
			out[""] = parts[2]
		}
		for _, c := range strings.Split(parts[1], ",") {
			out[c] = parts[2]
		}
	}
	return out
}

// Version is the interface m writes.
func (m *Manager) Version() Version { return m.version }

// Group is one sandbox's group (a directory per hierarchy).
type Group struct {
	version Version
	dirs    []string // v1: memory, cpu, pids; v2: one
}

// Create makes (or reuses) the group name with limits l.
func (m *Manager) Create(name string, l Limits) (*Group, error) {
	if name == "" || strings.ContainsAny(name, "/.") {
		return nil, fmt.Errorf("cgroup: bad group name %q", name)
	}
	g := &Group{version: m.version}
	for _, p := range m.parents {
		d := filepath.Join(p, name)
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		g.dirs = append(g.dirs, d)
	}
	if err := g.set(l); err != nil {
		_ = g.Remove()
		return nil, err
	}
	return g, nil
}

// Open names the existing group name (for its counters and removal).
func (m *Manager) Open(name string) *Group {
	g := &Group{version: m.version}
	for _, p := range m.parents {
		g.dirs = append(g.dirs, filepath.Join(p, name))
	}
	return g
}

func (g *Group) set(l Limits) error {
	type w struct{ dir, file, val string }
	var ws []w
	if g.version == V1 {
		mem, cpu, pids := g.dirs[0], g.dirs[1], g.dirs[2]
		if l.MemoryBytes > 0 {
			v := strconv.FormatUint(l.MemoryBytes, 10)
			// No swap past the limit where the kernel accounts it; memsw
			// must stay >= the limit, so a reused group that had a lower one
			// is raised first.
			memsw := filepath.Join(mem, "memory.memsw.limit_in_bytes")
			_, err := os.Stat(memsw)
			if err == nil {
				_ = os.WriteFile(memsw, []byte(v), 0)
			}
			ws = append(ws, w{mem, "memory.limit_in_bytes", v})
			if err == nil {
				ws = append(ws, w{mem, "memory.memsw.limit_in_bytes", v})
			}
			// At the limit the group's tasks wait instead of being killed
			// one by one: the service sees the group under OOM and stops
			// the whole sandbox with memory_limit while its turn is still
			// in flight (an OOM-killed command alone would end the turn
			// as a failed tool, and the reason would be lost).
			ws = append(ws, w{mem, "memory.oom_control", "1"})
		}
		if l.CPUMillis > 0 {
			ws = append(ws, w{cpu, "cpu.cfs_period_us", strconv.Itoa(cpuPeriod)},
				w{cpu, "cpu.cfs_quota_us", strconv.FormatUint(l.CPUMillis*cpuPeriod/1000, 10)})
		}
		if l.Pids > 0 {
			ws = append(ws, w{pids, "pids.max", strconv.FormatUint(l.Pids, 10)})
		}
	} else {
		d := g.dirs[0]
		if l.MemoryBytes > 0 {
			// v2 has no waiting at the limit: memory.high throttles (and
			// counts "high" events the service stops the sandbox on), and
			// memory.max a quarter above it is where the kernel kills.
			ws = append(ws, w{d, "memory.high", strconv.FormatUint(l.MemoryBytes, 10)},
				w{d, "memory.max", strconv.FormatUint(l.MemoryBytes+l.MemoryBytes/4, 10)}, w{d, "memory.swap.max", "0"})
		}
		if l.CPUMillis > 0 {
			ws = append(ws, w{d, "cpu.max", fmt.Sprintf("%d %d", l.CPUMillis*cpuPeriod/1000, cpuPeriod)})
		}
		if l.Pids > 0 {
			ws = append(ws, w{d, "pids.max", strconv.FormatUint(l.Pids, 10)})
		}
	}
	for _, x := range ws {
		if err := os.WriteFile(filepath.Join(x.dir, x.file), []byte(x.val), 0); err != nil {
			if x.file == "memory.swap.max" && errors.Is(err, os.ErrNotExist) {
				continue // no swap accounting: nothing to bound
			}
			return fmt.Errorf("cgroup: set %s: %w", x.file, err)
		}
	}
	return nil
}

// Add moves pid (the whole process) into the group, in every hierarchy.
func (g *Group) Add(pid int) error {
	for _, d := range g.dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("cgroup: add %d to %s: %w", pid, d, err)
		}
	}
	return nil
}

// MemoryEvents counts the group's memory-limit events: v1, OOM kills plus
// one while its tasks wait at the limit (under_oom); v2, OOM kills plus
// times it passed memory.high. A count that grew means the sandbox went
// over its memory limit.
func (g *Group) MemoryEvents() (uint64, error) {
	file, keys := "memory.oom_control", []string{"oom_kill", "under_oom"}
	if g.version == V2 {
		file, keys = "memory.events", []string{"oom_kill", "high"}
	}
	b, err := os.ReadFile(filepath.Join(g.dirs[0], file))
	if err != nil {
		return 0, err
	}
	var n uint64
	found := 0
	for _, line := range strings.Split(string(b), "\n") {
		for _, k := range keys {
			if v, ok := strings.CutPrefix(line, k+" "); ok {
				x, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
				if err != nil {
					return 0, fmt.Errorf("cgroup: %s in %s: %w", k, file, err)
				}
				n += x
				found++
			}
		}
	}
	if found != len(keys) {
		return 0, fmt.Errorf("cgroup: %v not all in %s", keys, file)
	}
	return n, nil
}

// Empty reports whether no process is left in the group (v1: in any of
// its hierarchies).
func (g *Group) Empty() bool {
	for _, d := range g.dirs {
		b, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil && !errors.Is(err, os.ErrNotExist) || len(strings.TrimSpace(string(b))) > 0 {
			return false
		}
	}
	return true
}

// Remove removes the group's directories; it fails while processes remain.
func (g *Group) Remove() error {
	var errs []error
	for _, d := range g.dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Names lists the groups under the manager (for sweeping groups left by a
// previous run).
func (m *Manager) Names() ([]string, error) {
	ents, err := os.ReadDir(m.parents[0])
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// Kill sends SIGKILL to every process of the group (v1: as the memory
// hierarchy lists them).
func (g *Group) Kill() error {
	b, err := os.ReadFile(filepath.Join(g.dirs[0], "cgroup.procs"))
	if err != nil {
		return err
	}
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	return nil
}
