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

	"agentplane.dev/services/sandbox/internal/provider"
)

// EnvWorkspace names the workspace directory (WorkspaceName) a wrapper
// serves. It is informational, not a marker: capacity cleanup uses it to
// keep directories that a live wrapper serves.
const EnvWorkspace = "AGENTPLANE_WORKSPACE_NAME"

// procInfo is one live process as the host's /proc shows it.
type procInfo struct {
	pid, ppid, pgid int
	start           uint64 // start time in clock ticks: tells a reused pid apart
	pidNS           string // readlink of ns/pid, e.g. "pid:[4026531836]"
	vars            map[string]string
}

// scanAll lists every live (non-zombie) process with its parent, process
// group, PID namespace and environment. Any failure to look (the listing, or
// a file of a process that exists but cannot be read, unless the process is
// provably not ours) is an error: the caller reports inspection_failed,
// never absent.
func scanAll(procRoot string, self identity) (map[int]*procInfo, string, error) {
	selfNS, err := os.Readlink(filepath.Join(procRoot, "self", "ns", "pid"))
	if err != nil {
		return nil, "", fmt.Errorf("read own pid namespace: %w", err)
	}
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, "", fmt.Errorf("list %s: %w", procRoot, err)
	}
	out := map[int]*procInfo{}
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
			return nil, "", fmt.Errorf("read stat of pid %d: %w", pid, err)
		}
		if st.state == 'Z' || st.state == 'X' {
			continue // exited; only its exit status is left
		}
		env, err := os.ReadFile(filepath.Join(dir, "environ"))
		var ns string
		if err == nil {
			ns, err = os.Readlink(filepath.Join(dir, "ns", "pid"))
		}
		if vanished(err) {
			// Exiting: parts of its /proc entry are gone already. Keep
			// what stat said (a namespace's init that ends its namespace
			// is in this state until its last process is gone).
			out[pid] = &procInfo{pid: pid, ppid: st.ppid, pgid: st.pgid, start: st.start}
			continue
		}
		if err != nil {
			foreign, ferr := provablyForeign(filepath.Join(dir, "status"), self)
			if vanished(ferr) || ferr == nil && foreign {
				continue
			}
			return nil, "", fmt.Errorf("inspect pid %d: %w", pid, err)
		}
		out[pid] = &procInfo{pid: pid, ppid: st.ppid, pgid: st.pgid, start: st.start, pidNS: ns, vars: parseEnviron(env)}
	}
	return out, selfNS, nil
}

// unit is one launched wrapper with everything that belongs to it: the
// anchor (the marked process in the service's own PID namespace: the
// wrapper itself without isolation, its bubblewrap with it) and every
// process of the PID namespaces it created, whatever their environment,
// process group or session.
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
// and start time, so a reused pid or namespace inode never matches.
type nsRecord struct {
	RuntimeKey  string `json:"runtime_key"`
	Instance    string `json:"instance"`
	Generation  uint64 `json:"generation"`
	Workspace   string `json:"workspace"`
	AnchorPID   int    `json:"anchor_pid"`
	AnchorStart uint64 `json:"anchor_start"`
	InitPID     int    `json:"init_pid"`
	InitStart   uint64 `json:"init_start"`
	PidNS       string `json:"pid_ns"`
}

// units finds the sandbox's wrappers. Markers are trusted only on processes
// in the service's own PID namespace (code inside a sandbox can rewrite its
// own environ, but cannot create a process out there). A process inside a
// sandbox's namespace belongs to the unit whose anchor is the parent of the
// namespace's init, or whose record names that init: a namespace whose
// bubblewrap already died still counts until its last process is gone.
func units(procs map[int]*procInfo, selfNS string, sc scope, sandboxID string, records []nsRecord) []*unit {
	byAnchor := map[int]*unit{}
	var out []*unit
	for _, p := range procs {
		if p.pidNS == selfNS && sc.ours(p.vars, sandboxID) {
			u := &unit{anchor: p}
			byAnchor[p.pid] = u
			out = append(out, u)
		}
	}
	byNS := map[string][]*procInfo{}
	for _, p := range procs {
		if p.pidNS != selfNS && p.pidNS != "" {
			byNS[p.pidNS] = append(byNS[p.pidNS], p)
		}
	}
	owner := map[string]*unit{}
	for _, r := range records {
		// The kernel ends every process of a namespace before its init
		// becomes a zombie: while the init lives, the namespace may.
		init := procs[r.InitPID]
		if init == nil || init.start != r.InitStart || r.PidNS == "" || r.PidNS == selfNS {
			continue
		}
		if a := procs[r.AnchorPID]; a != nil && a.start == r.AnchorStart && byAnchor[a.pid] != nil {
			owner[r.PidNS] = byAnchor[a.pid]
			continue
		}
		if _, ok := byNS[r.PidNS]; !ok {
			byNS[r.PidNS] = []*procInfo{init} // the init alone, mid-exit
		}
		u := &unit{anchor: &procInfo{pid: init.pid, ppid: init.ppid, start: init.start, pidNS: r.PidNS, vars: map[string]string{
			provider.EnvRuntimeKey: r.RuntimeKey, provider.EnvInstance: r.Instance,
			provider.EnvGeneration: strconv.FormatUint(r.Generation, 10), EnvWorkspace: r.Workspace,
		}}, orphan: true}
		owner[init.pidNS] = u
		out = append(out, u)
	}
	// Namespaces whose init's parent is an anchor, then namespaces nested in
	// those, to a fixed point (nesting needs capabilities a sandbox does not
	// have, so one round is the norm).
	for changed := true; changed; {
		changed = false
		for ns, ps := range byNS {
			if owner[ns] != nil {
				continue
			}
			for _, p := range ps {
				parent := procs[p.ppid]
				if parent == nil || parent.pidNS == ns {
					continue
				}
				if u := byAnchor[parent.pid]; u != nil && parent.pidNS == selfNS {
					owner[ns], changed = u, true
				} else if u := owner[parent.pidNS]; u != nil && parent.pidNS != selfNS {
					owner[ns], changed = u, true
				}
			}
		}
	}
	for ns, ps := range byNS {
		u := owner[ns]
		if u == nil {
			continue
		}
		for _, p := range ps {
			if parent := procs[p.ppid]; parent == nil || parent.pidNS != ns {
				u.inits = append(u.inits, p)
			}
			u.members = append(u.members, p)
		}
	}
	return out
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

// identity is what a process launched by this service inherits from it.
type identity struct {
	uid    uint64
	capPrm uint64
}

// selfIdentity reads this process's uid and permitted capabilities. If they
// cannot be read, nothing is provably foreign.
func selfIdentity() identity {
	id, err := readIdentity("/proc/self/status")
	if err != nil {
		return identity{uid: uint64(os.Geteuid()), capPrm: ^uint64(0)}
	}
	return id
}

// provablyForeign reports whether a process whose environ we cannot read
// cannot be a wrapper of ours: it holds capabilities we do not have, or
// (when we are not root) runs as another user. Our wrappers inherit our uid
// and at most our capabilities, so such a process carries no markers of
// ours. Every other unreadable process is an inspection failure.
func provablyForeign(statusPath string, self identity) (bool, error) {
	id, err := readIdentity(statusPath)
	if err != nil {
		return false, err
	}
	if id.capPrm&^self.capPrm != 0 {
		return true, nil
	}
	return self.uid != 0 && id.uid != self.uid, nil
}

func readIdentity(path string) (identity, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return identity{}, err
	}
	var id identity
	var haveUID, haveCap bool
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		switch {
		case k == "Uid" && len(f) >= 2: // effective uid
			id.uid, err = strconv.ParseUint(f[1], 10, 32)
			haveUID = err == nil
		case k == "CapPrm" && len(f) == 1:
			id.capPrm, err = strconv.ParseUint(f[0], 16, 64)
			haveCap = err == nil
		}
	}
	if !haveUID || !haveCap {
		return identity{}, fmt.Errorf("malformed %s", path)
	}
	return id, nil
}
