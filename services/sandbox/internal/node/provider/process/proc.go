package process

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// EnvWorkspace names the workspace directory (WorkspaceName) a wrapper
// serves. It is informational, not a marker: capacity cleanup uses it to
// keep directories that a live wrapper serves.
const EnvWorkspace = "AGENTPLANE_WORKSPACE_NAME"

// procInfo is one live process as the /proc of the service shows it. Every
// field but vars comes from the world-readable stat and status files, which
// no process can make unreadable (a non-dumpable process hands its other
// files to root, DESIGN.md 3.3 "Discovery no sandbox can blind").
type procInfo struct {
	pid, ppid, pgid int
	start           uint64 // start time in clock ticks: tells a reused pid apart
	depth           int    // PID namespaces below the /proc's one it runs in (NSpid entries - 1)
	// Anchor candidates only (processes at the service's own depth): their
	// environment and PID namespace, or why they could not be read.
	vars   map[string]string
	pidNS  string
	envErr error
}

// procTable is one scan of /proc: every live (non-zombie) process, and
// where the service itself is.
type procTable struct {
	procs     map[int]*procInfo
	self      int    // this process's pid
	selfDepth int    // its depth: anchors run at this depth
	selfNS    string // readlink of its ns/pid
}

// scanAll lists every live process with its parent, process group, start
// time and PID namespace depth, and reads the environment of the anchor
// candidates only: the processes at the service's own depth other than
// itself. Nothing inside a sandbox runs at that depth, so nothing inside a
// sandbox can make a candidate unreadable; a candidate that cannot be read
// is recorded (envErr), and units decides whether it concerns the sandbox
// asked about. A failed listing, or a stat or status file of a live process
// that cannot be read (both are world-readable), is an error: the caller
// reports inspection_failed, never absent.
func scanAll(procRoot string) (*procTable, error) {
	selfLink, err := os.Readlink(filepath.Join(procRoot, "self"))
	if err != nil {
		return nil, fmt.Errorf("read own pid: %w", err)
	}
	self, err := strconv.Atoi(selfLink)
	if err != nil {
		return nil, fmt.Errorf("read own pid: %q", selfLink)
	}
	selfNS, err := os.Readlink(filepath.Join(procRoot, "self", "ns", "pid"))
	if err != nil {
		return nil, fmt.Errorf("read own pid namespace: %w", err)
	}
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", procRoot, err)
	}
	t := &procTable{procs: map[int]*procInfo{}, self: self, selfNS: selfNS, selfDepth: -1}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		dir := filepath.Join(procRoot, e.Name())
		st, err := readStat(filepath.Join(dir, "stat"))
		if vanished(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read stat of pid %d: %w", pid, err)
		}
		if st.state == 'Z' || st.state == 'X' {
			continue // exited; only its exit status is left
		}
		depth, err := readDepth(filepath.Join(dir, "status"))
		if vanished(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read status of pid %d: %w", pid, err)
		}
		t.procs[pid] = &procInfo{pid: pid, ppid: st.ppid, pgid: st.pgid, start: st.start, depth: depth}
		if pid == self {
			t.selfDepth = depth
		}
	}
	if t.selfDepth < 0 {
		return nil, fmt.Errorf("own pid %d is not in %s", self, procRoot)
	}
	for _, p := range t.procs {
		if p.depth == t.selfDepth && p.pid != self {
			readCandidate(filepath.Join(procRoot, strconv.Itoa(p.pid)), p)
		}
	}
	return t, nil
}

// readCandidate reads an anchor candidate's environment, and the PID
// namespace of one that carries a sandbox marker (markers count only in the
// service's own namespace). A candidate that exits meanwhile keeps no
// environment: it is no anchor any more.
func readCandidate(dir string, p *procInfo) {
	env, err := os.ReadFile(filepath.Join(dir, "environ"))
	if err == nil {
		p.vars = parseEnviron(env)
		if _, marked := p.vars[provider.EnvSandbox]; marked {
			p.pidNS, err = os.Readlink(filepath.Join(dir, "ns", "pid"))
		}
	}
	switch {
	case vanished(err):
		p.vars, p.pidNS = nil, ""
	case err != nil:
		p.vars, p.pidNS, p.envErr = nil, "", err
	}
}

// unit is one launched wrapper with everything that belongs to it: the
// anchor (the marked process in the service's own PID namespace: the
// wrapper itself without isolation, its bubblewrap with it) and every
// process descending from it in the PID namespaces it created (the agent's
// nested sandbox too), whatever their environment, process group or
// session.
type unit struct {
	anchor  *procInfo
	orphan  bool        // the anchor is a namespace's init whose bubblewrap is gone
	inits   []*procInfo // the namespaces' init processes
	members []*procInfo // every process inside those namespaces
}

// scope is what makes a process ours: the deployment and sandbox root
// markers equal to this provider's.
type scope struct{ deployment, root string }

func (s scope) ours(vars map[string]string, sandboxID string) bool {
	v, ok := vars[provider.EnvSandbox]
	return ok && v == sandboxID && vars[provider.EnvDeployment] == s.deployment && vars[provider.EnvSandboxRoot] == s.root
}

// nsRecord is written by the provider when bubblewrap names its namespace's
// init, under the sandbox's run/ directory, which nothing inside a sandbox
// can reach: it ties the namespace to its wrapper even when the wrapper's
// bubblewrap is gone (killed, or exited while the init still ends what was
// left), without trusting any environment inside. The init is named by pid
// and start time, so a reused pid never matches. (Records written before
// discovery went by the process tree also carry a pid_ns, now ignored.)
type nsRecord struct {
	RuntimeKey  string `json:"runtime_key"`
	Instance    string `json:"instance"`
	Generation  uint64 `json:"generation"`
	Workspace   string `json:"workspace"`
	AnchorPID   int    `json:"anchor_pid"`
	AnchorStart uint64 `json:"anchor_start"`
	InitPID     int    `json:"init_pid"`
	InitStart   uint64 `json:"init_start"`
	// Pool, on the record of a claimed pooled wrapper (pool.go), is the
	// sandbox marker its environment still carries: its anchor is this
	// sandbox's, under the record's key, instance and generation.
	Pool string `json:"pool,omitempty"`
}

// units finds the sandbox's wrappers. Markers are trusted only on processes
// in the service's own PID namespace (code inside a sandbox can rewrite its
// own environ, but cannot create a process out there). A process inside a
// sandbox belongs to the unit of the first anchor among its ancestors, or
// to the orphaned namespace whose record names its init: a namespace whose
// bubblewrap already died still counts until its last process is gone.
//
// It fails only for what concerns this sandbox, or could: an anchor
// candidate that cannot be read while a record of this sandbox names it,
// or that is a child of this service (launched by it, for a sandbox it
// cannot tell). Any other unreadable process (another service, whatever a
// sandbox does to its own processes) is not this sandbox's wrapper.
func units(t *procTable, sc scope, sandboxID string, records []nsRecord) ([]*unit, error) {
	byAnchor, out, err := anchorUnits(t, sc, sandboxID, records)
	if err != nil {
		return nil, err
	}
	byInit, orphans := orphanUnits(t, records, byAnchor)
	out = append(out, orphans...)
	assignMembers(t, byAnchor, byInit)
	return out, nil
}

// sameProc reports whether p is the process pid that started at start
// (not a later one that reused its pid).
func sameProc(p *procInfo, pid int, start uint64) bool {
	return p != nil && p.pid == pid && p.start == start
}

// anchorUnits finds the sandbox's live bubblewraps: the processes at the
// service's depth whose environment names this sandbox, each the anchor
// of a unit. out lists them in the table's order.
func anchorUnits(t *procTable, sc scope, sandboxID string, records []nsRecord) (map[int]*unit, []*unit, error) {
	for _, r := range records {
		if a := t.procs[r.AnchorPID]; sameProc(a, r.AnchorPID, r.AnchorStart) && a.envErr != nil {
			return nil, nil, fmt.Errorf("inspect pid %d (recorded wrapper of this sandbox): %w", a.pid, a.envErr)
		}
	}
	byAnchor := map[int]*unit{}
	var out []*unit
	for _, p := range t.procs {
		if p.depth != t.selfDepth || p.pid == t.self {
			continue
		}
		if p.envErr != nil && p.ppid == t.self {
			return nil, nil, fmt.Errorf("inspect pid %d (a child of this service): %w", p.pid, p.envErr)
		}
		if p.pidNS == t.selfNS && sc.ours(p.vars, sandboxID) {
			u := &unit{anchor: p}
			byAnchor[p.pid] = u
			out = append(out, u)
		}
	}
	for _, r := range records {
		a := t.procs[r.AnchorPID]
		if r.Pool == "" || !sameProc(a, r.AnchorPID, r.AnchorStart) || a.depth != t.selfDepth || a.pidNS != t.selfNS || !sc.ours(a.vars, r.Pool) {
			continue
		}
		// A claimed pooled wrapper: its environment names the pool, the
		// record (which nothing inside a sandbox can write) its key.
		claimed := *a
		claimed.vars = recordVars(r)
		u := &unit{anchor: &claimed}
		byAnchor[a.pid] = u
		out = append(out, u)
	}
	return byAnchor, out, nil
}

// orphanUnits finds the recorded namespaces whose bubblewrap is gone but
// whose init lives: the kernel ends every process of a namespace before
// its init becomes a zombie, so while the init lives, the namespace may.
// Each is a unit anchored at its init (byInit: by the init's pid; orphans:
// in the records' order).
func orphanUnits(t *procTable, records []nsRecord, byAnchor map[int]*unit) (byInit map[int]*unit, orphans []*unit) {
	byInit = map[int]*unit{}
	for _, r := range records {
		init := t.procs[r.InitPID]
		if !sameProc(init, r.InitPID, r.InitStart) || init.depth <= t.selfDepth {
			continue
		}
		if a := t.procs[r.AnchorPID]; sameProc(a, r.AnchorPID, r.AnchorStart) && byAnchor[a.pid] != nil {
			continue // its bubblewrap lives: the tree below it is found from there
		}
		u := &unit{anchor: &procInfo{pid: init.pid, ppid: init.ppid, start: init.start, depth: init.depth, vars: recordVars(r)}, orphan: true}
		byInit[init.pid] = u
		orphans = append(orphans, u)
	}
	return byInit, orphans
}

// recordVars are the markers a namespace record names.
func recordVars(r nsRecord) map[string]string {
	return map[string]string{
		provider.EnvRuntimeKey: r.RuntimeKey, provider.EnvInstance: r.Instance,
		provider.EnvGeneration: strconv.FormatUint(r.Generation, 10), EnvWorkspace: r.Workspace,
	}
}

// assignMembers gives every process below the service's depth to its
// unit, by ancestry. A process's parent is in its own PID namespace or (a
// namespace's init) in the one above, and an orphan is reparented within
// its namespace, so the walk up from any process inside a sandbox passes
// its namespace's init and ends at the bubblewrap that created it.
func assignMembers(t *procTable, byAnchor, byInit map[int]*unit) {
	procs := t.procs
	owner := map[int]*unit{}
	var ownerOf func(p *procInfo, hops int) *unit
	ownerOf = func(p *procInfo, hops int) *unit {
		if u, ok := owner[p.pid]; ok {
			return u
		}
		var u *unit
		parent := procs[p.ppid]
		switch {
		case byInit[p.pid] != nil:
			u = byInit[p.pid]
		case parent == nil || hops > len(procs) || parent.depth > p.depth:
		case parent.depth == t.selfDepth:
			u = byAnchor[parent.pid]
		case parent.depth > t.selfDepth:
			u = ownerOf(parent, hops+1)
		}
		owner[p.pid] = u
		return u
	}
	for _, p := range procs {
		if p.depth <= t.selfDepth {
			continue
		}
		u := ownerOf(p, 0)
		if u == nil {
			continue
		}
		if parent := procs[p.ppid]; parent == nil || parent.depth < p.depth {
			u.inits = append(u.inits, p)
		}
		u.members = append(u.members, p)
	}
}

// vanished reports an error that means the process exited while we looked.
func vanished(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH)
}

// parseEnviron splits a NUL-separated environ. The first occurrence of a
// name wins, as with getenv.
func parseEnviron(b []byte) map[string]string {
	vars := map[string]string{}
	for _, kv := range bytes.Split(b, []byte{0}) {
		k, v, ok := strings.Cut(string(kv), "=")
		if !ok || k == "" {
			continue
		}
		if _, seen := vars[k]; !seen {
			vars[k] = v
		}
	}
	return vars
}

type statFields struct {
	state      byte
	ppid, pgid int
	start      uint64
}

// readStat reads state, parent, process group and start time of
// /proc/<pid>/stat. The command name is in parentheses and may contain
// anything, so fields are read after the last ')'.
func readStat(path string) (statFields, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return statFields{}, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return statFields{}, fmt.Errorf("malformed %s", path)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 3 || len(f[0]) != 1 {
		return statFields{}, fmt.Errorf("malformed %s", path)
	}
	st := statFields{state: f[0][0]}
	if st.ppid, err = strconv.Atoi(f[1]); err != nil {
		return statFields{}, fmt.Errorf("malformed %s: %w", path, err)
	}
	if st.pgid, err = strconv.Atoi(f[2]); err != nil {
		return statFields{}, fmt.Errorf("malformed %s: %w", path, err)
	}
	if len(f) > 19 { // field 22 of stat, the 20th after the command name
		st.start, _ = strconv.ParseUint(f[19], 10, 64)
	}
	return st, nil
}

// readDepth reads how many PID namespaces below the /proc's one a process
// runs: its NSpid line in status lists its pid in each namespace from the
// /proc's down to its own.
func readDepth(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			if n := len(strings.Fields(v)); n > 0 {
				return n - 1, nil
			}
		}
	}
	return 0, fmt.Errorf("malformed %s: no NSpid", path)
}
