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
	FileSize     uint64 // RLIMIT_FSIZE, bytes: the largest file one write may make
	CPUSeconds   uint64 // RLIMIT_CPU, seconds of CPU per process (SIGKILL past it: soft = hard)
}

// DefaultLimits leave room for a Node agent (V8 reserves several GiB of
// address space up front) and a build it runs, and keep what one sandbox
// can hold of the host's shared tables small: nofile × nproc = 512 Ki open
// files at most, a fifth of a 24 GiB node's fs.file-max (2.4 Mi); one file
// at most 4 GiB (the disk quota bounds the sum); 4 h of CPU per process.
var DefaultLimits = Limits{OpenFiles: 1024, Processes: 512, AddressSpace: 64 << 30, FileSize: 4 << 30, CPUSeconds: 4 * 3600}

var limitNames = []struct {
	name     string
	resource int
	field    func(*Limits) *uint64
}{
	{"nofile", syscall.RLIMIT_NOFILE, func(l *Limits) *uint64 { return &l.OpenFiles }},
	{"nproc", 6 /* RLIMIT_NPROC */, func(l *Limits) *uint64 { return &l.Processes }},
	{"as", syscall.RLIMIT_AS, func(l *Limits) *uint64 { return &l.AddressSpace }},
	{"fsize", syscall.RLIMIT_FSIZE, func(l *Limits) *uint64 { return &l.FileSize }},
	{"cpu", syscall.RLIMIT_CPU, func(l *Limits) *uint64 { return &l.CPUSeconds }},
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
			return Limits{}, fmt.Errorf("rlimit %q: unknown (want nofile, nproc, as, fsize or cpu)", k)
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

// FileTableShare is what share of the host's file table (fs.file-max) one
// sandbox may hold at most, nofile × nproc, before start-up warns.
const FileTableShare = 4

// CheckFileTable says why l lets one sandbox open too much of the host's
// file table (fileMax: /proc/sys/fs/file-max), or "" when it does not.
func (l Limits) CheckFileTable(fileMax uint64) string {
	if l.OpenFiles == 0 || l.Processes == 0 {
		return "nofile or nproc is unbounded: one sandbox can exhaust the host's file table"
	}
	if fileMax > 0 && l.OpenFiles*l.Processes > fileMax/FileTableShare {
		return fmt.Sprintf("nofile × nproc = %d exceeds a %dth of the host's fs.file-max (%d): one sandbox can starve the others of open files",
			l.OpenFiles*l.Processes, FileTableShare, fileMax)
	}
	return ""
}

// HostFileMax reads /proc/sys/fs/file-max (0 when it cannot).
func HostFileMax() uint64 {
	b, err := os.ReadFile("/proc/sys/fs/file-max")
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	return n
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
