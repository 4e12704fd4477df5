package boundary

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// Limits are a sandbox's resource limits by rlimit; 0 leaves one unset.
// The wrapper applies them to itself (soft = hard) before it starts the
// runtime: inside the sandbox nothing holds CAP_SYS_RESOURCE in the host's
// user namespace, so no descendant can raise a hard limit again.
type Limits struct {
	OpenFiles    uint64 // RLIMIT_NOFILE
	Processes    uint64 // RLIMIT_NPROC (counted per user namespace, so per sandbox)
	AddressSpace uint64 // RLIMIT_AS, bytes
}

// DefaultLimits leave room for a Node agent (V8 reserves several GiB of
// address space up front) and a build it runs.
var DefaultLimits = Limits{OpenFiles: 4096, Processes: 1024, AddressSpace: 64 << 30}

var limitNames = []struct {
	name     string
	resource int
	field    func(*Limits) *uint64
}{
	{"nofile", syscall.RLIMIT_NOFILE, func(l *Limits) *uint64 { return &l.OpenFiles }},
	{"nproc", 6 /* RLIMIT_NPROC */, func(l *Limits) *uint64 { return &l.Processes }},
	{"as", syscall.RLIMIT_AS, func(l *Limits) *uint64 { return &l.AddressSpace }},
}

// String is the wrapper's --rlimits value, e.g. "nofile=4096,nproc=1024".
func (l Limits) String() string {
	var parts []string
	for _, n := range limitNames {
		if v := *n.field(&l); v > 0 {
			parts = append(parts, n.name+"="+strconv.FormatUint(v, 10))
		}
	}
	return strings.Join(parts, ",")
}

// ParseLimits reads String's form; unknown names and zero or malformed
// values are errors.
func ParseLimits(s string) (Limits, error) {
	var l Limits
	if s == "" {
		return l, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return Limits{}, fmt.Errorf("rlimit %q: want name=value", kv)
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n == 0 {
			return Limits{}, fmt.Errorf("rlimit %q: want a positive integer", kv)
		}
		found := false
		for _, ln := range limitNames {
			if ln.name == k {
				*ln.field(&l), found = n, true
			}
		}
		if !found {
			return Limits{}, fmt.Errorf("rlimit %q: unknown (want nofile, nproc or as)", k)
		}
	}
	return l, nil
}

// Apply sets each limit as both soft and hard limit of this process (and so
// of everything it starts). syscall.Setrlimit also tells the Go runtime not
// to restore its own NOFILE default in children.
func (l Limits) Apply() error {
	var errs []error
	for _, n := range limitNames {
		v := *n.field(&l)
		if v == 0 {
			continue
		}
		var cur syscall.Rlimit
		if err := syscall.Getrlimit(n.resource, &cur); err == nil && cur.Max < v {
			v = cur.Max // never ask for more than we have: that needs a capability
		}
		if err := syscall.Setrlimit(n.resource, &syscall.Rlimit{Cur: v, Max: v}); err != nil {
			errs = append(errs, fmt.Errorf("setrlimit %s=%d: %w", n.name, v, err))
		}
	}
	return errors.Join(errs...)
}

// CgroupLimits reports whether per-sandbox memory, pids and CPU limits by
// cgroup are available, and why not. They are not implemented yet: on a
// cgroup v1 host (this project's CI) they cannot be, and on cgroup v2 the
// delegation is not wired. Start-up logs the answer; the rlimits hold anyway.
func CgroupLimits() (bool, string) {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err != nil {
		return false, "the host has no cgroup v2 unified hierarchy (cgroup v1): memory, pids and CPU limits per sandbox are unavailable; rlimits are enforced"
	}
	return false, "cgroup v2 is present but per-sandbox cgroup delegation is not implemented: memory, pids and CPU limits per sandbox are unavailable; rlimits are enforced"
}
