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

// procEntry is one process of a sandbox seen in /proc.
type procEntry struct {
	pid        int
	pgid       int
	runtimeKey string
	hasKey     bool
	instance   string
	generation uint64
	unmarked   bool
	workspace  string
}

// scan lists every live (non-zombie) process whose environ carries the
// sandbox marker with exactly sandboxID. Any failure to look (the listing,
// or an environ/stat that exists but cannot be read) is an error: the
// caller reports inspection_failed, never absent.
func scan(procRoot, sandboxID string, self identity) ([]procEntry, error) {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", procRoot, err)
	}
	var out []procEntry
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		env, err := os.ReadFile(filepath.Join(procRoot, e.Name(), "environ"))
		if vanished(err) {
			continue
		}
		if err != nil {
			foreign, ferr := provablyForeign(filepath.Join(procRoot, e.Name(), "status"), self)
			if vanished(ferr) || ferr == nil && foreign {
				continue
			}
			return nil, fmt.Errorf("read environ of pid %d: %w", pid, err)
		}
		vars := parseEnviron(env)
		if v, ok := vars[provider.EnvSandbox]; !ok || v != sandboxID {
			continue
		}
		state, pgid, err := readStat(filepath.Join(procRoot, e.Name(), "stat"))
		if vanished(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read stat of pid %d: %w", pid, err)
		}
		if state == 'Z' || state == 'X' {
			continue // exited; only its exit status is left
		}
		pe := procEntry{pid: pid, pgid: pgid, workspace: vars[EnvWorkspace]}
		pe.runtimeKey, pe.hasKey = vars[provider.EnvRuntimeKey]
		inst, hasInst := vars[provider.EnvInstance]
		gen, genErr := strconv.ParseUint(vars[provider.EnvGeneration], 10, 64)
		if !hasInst || inst == "" || genErr != nil {
			pe.unmarked = true
		} else {
			pe.instance, pe.generation = inst, gen
		}
		out = append(out, pe)
	}
	return out, nil
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

// readStat returns the state and process group of /proc/<pid>/stat. The
// command name is in parentheses and may contain anything, so fields are
// read after the last ')'.
func readStat(path string) (byte, int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("malformed %s", path)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 3 || len(f[0]) != 1 {
		return 0, 0, fmt.Errorf("malformed %s", path)
	}
	pgid, err := strconv.Atoi(f[2])
	if err != nil {
		return 0, 0, fmt.Errorf("malformed %s: %w", path, err)
	}
	return f[0][0], pgid, nil
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
