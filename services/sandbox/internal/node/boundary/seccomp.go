// Package boundary builds what puts a sandbox's wrapper, and everything it
// starts, behind a boundary (DESIGN.md 3.3): the bubblewrap command line
// (namespaces, filesystem view, no capabilities, no_new_privs), the seccomp
// program bubblewrap installs, the resource limits the wrapper applies to
// itself before it starts untrusted code, and the probe that tells whether
// this host allows any of it.
package boundary

import (
	"encoding/binary"
	"fmt"
	"slices"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// refused are the system calls a sandbox gets EPERM for: those that reach
// past the namespaces (ptrace and reading other processes' memory, mounts,
// new namespaces, kernel keyrings, BPF, perf, kexec, modules) even though
// the missing capabilities already refuse most of them; the filter is the
// second wall if a kernel bug lets a capability check through.
var refused = []string{
	"ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
	"mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
	"fsmount", "fspick", "mount_setattr",
	"unshare", "setns",
	"kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
	"bpf", "perf_event_open", "userfaultfd",
	"keyctl", "add_key", "request_key",
	"open_by_handle_at", "name_to_handle_at", "acct", "quotactl", "swapon", "swapoff",
	"iopl", "ioperm", "syslog", "lookup_dcookie", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
	// Reached without a capability, and kernel surface a coding agent does
	// not need (Docker's default profile refuses them too): io_uring runs
	// operations that no seccomp filter sees, memfd_secret hides memory
	// from the kernel's own views, kcmp compares other processes' kernel
	// objects, move_pages and migrate_pages move other processes' pages.
	"io_uring_setup", "io_uring_enter", "io_uring_register", "memfd_secret", "kcmp", "move_pages", "migrate_pages",
	"fanotify_init", "quotactl_fd", "vhangup",
}

// refusedObsolete are refused where the architecture still has them
// (x86-64 does; newer ones never had them).
var refusedObsolete = []string{"uselib", "ustat", "sysfs", "_sysctl", "nfsservctl"}

// Socket families a sandbox may open (an allowlist, stricter than Docker's
// refusal of AF_VSOCK and OpenShell's of AF_PACKET, AF_BLUETOOTH and
// AF_VSOCK): Unix, IPv4, IPv6 and netlink for NETLINK_ROUTE only, which
// getifaddrs needs (Node's os.networkInterfaces, glibc's AI_ADDRCONFIG)
// and which shows only the sandbox's own network namespace. Every other
// family (vsock to the host's hypervisor, the other netlink protocols,
// AF_ALG, AF_PACKET, AF_KEY, the rarely used protocol families with a
// history of kernel bugs) gets EPERM.
var allowedFamilies = []uint64{unix.AF_UNIX, unix.AF_INET, unix.AF_INET6, unix.AF_NETLINK}

// allowedPersonas are the personality() arguments a sandbox may pass
// (Docker's default profile's): the default persona, PER_LINUX32,
// UNAME26, both, and 0xffffffff, which only queries. Any other flag
// (READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, ...) gets EPERM.
var allowedPersonas = []uint64{0, perLinux32, uname26, perLinux32 | uname26, 0xffffffff}

const (
	perLinux32 = 0x0008  // <linux/personality.h>
	uname26    = 0x20000 // <linux/personality.h>
)

// conditioned are the system calls refused for some arguments only. Each
// condition compares all 64 bits of an argument while the kernel reads a
// 32-bit int: every rule is written so that set high bits refuse (a value
// is refused unless it equals an allowed one), never so that they let a
// refused value through.
func conditioned() []seccomp.NameWithConditions {
	notIn := func(arg uint32, values []uint64) seccomp.ArgumentConditions {
		var c seccomp.ArgumentConditions
		for _, v := range values {
			c = append(c, seccomp.Condition{Argument: arg, Operation: seccomp.NotEqual, Value: v})
		}
		return c
	}
	netlinkNotRoute := seccomp.ArgumentConditions{
		{Argument: 0, Operation: seccomp.Equal, Value: unix.AF_NETLINK},
		{Argument: 2, Operation: seccomp.NotEqual, Value: unix.NETLINK_ROUTE},
	}
	return []seccomp.NameWithConditions{
		{Name: "clone", Conditions: seccomp.ArgumentConditions{{Argument: 0, Operation: seccomp.BitsSet, Value: unix.CLONE_NEWUSER}}},
		{Name: "socket", Conditions: notIn(0, allowedFamilies)},
		{Name: "socket", Conditions: netlinkNotRoute},
		{Name: "socketpair", Conditions: notIn(0, allowedFamilies)},
		{Name: "personality", Conditions: notIn(0, allowedPersonas)},
	}
}

// SeccompProgram returns the filter as bubblewrap's --seccomp reads it: an
// array of struct sock_filter in host byte order. On a foreign architecture
// (a 32-bit ABI called from a 64-bit process) it kills the process rather
// than let a second syscall table bypass the list; clone3, whose flags a
// classic BPF filter cannot read, answers ENOSYS so libc falls back to
// clone, whose CLONE_NEWUSER flag the filter refuses.
func SeccompProgram() ([]byte, error) { return seccompProgram(false) }

// nesting are the calls of refused that bubblewrap needs to build the
// agent's nested sandbox (new user, PID and mount namespaces, a fresh
// /proc, pivot_root into the new root).
var nesting = map[string]bool{"unshare": true, "mount": true, "umount2": true, "pivot_root": true}

// SupervisorSeccompProgram is the filter of the wrapper's own sandbox: the
// same as SeccompProgram except the calls of nesting and clone with
// CLONE_NEWUSER, which the wrapper's second bubblewrap needs to put the
// agent in its nested sandbox, where SeccompProgram applies again (filters
// stack: a call passes only if every filter lets it). Only the wrapper, its
// git commands and that bubblewrap run under it alone.
func SupervisorSeccompProgram() ([]byte, error) { return seccompProgram(true) }

func seccompProgram(supervisor bool) ([]byte, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w", err)
	}
	clone3, ok := info.SyscallNames["clone3"]
	if !ok {
		return nil, fmt.Errorf("seccomp: no clone3 on %s", info.Name)
	}
	names := slices.Clone(refused)
	for _, n := range refusedObsolete {
		if _, ok := info.SyscallNames[n]; ok {
			names = append(names, n)
		}
	}
	conds := conditioned()
	if supervisor {
		names = slices.DeleteFunc(names, func(n string) bool { return nesting[n] })
		conds = slices.DeleteFunc(conds, func(c seccomp.NameWithConditions) bool { return c.Name == "clone" })
	}
	policy := seccomp.Policy{
		DefaultAction: seccomp.ActionAllow,
		Syscalls: []seccomp.SyscallGroup{
			{Action: seccomp.ActionErrno, Names: names},
			{Action: seccomp.ActionErrno, NamesWithCondtions: conds},
		},
	}
	body, err := policy.Assemble()
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w", err)
	}
	const (
		offNr   = 0 // struct seccomp_data: int nr; __u32 arch; ...
		offArch = 4
	)
	prefix := []bpf.Instruction{
		bpf.LoadAbsolute{Off: offArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(info.ID), SkipTrue: 1},
		bpf.RetConstant{Val: unix.SECCOMP_RET_KILL_PROCESS},
		bpf.LoadAbsolute{Off: offNr, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: uint32(clone3), SkipTrue: 1},
		bpf.RetConstant{Val: unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)},
	}
	raw, err := bpf.Assemble(append(prefix, body...))
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w", err)
	}
	out := make([]byte, 0, 8*len(raw))
	for _, ins := range raw {
		out = binary.NativeEndian.AppendUint16(out, ins.Op)
		out = append(out, ins.Jt, ins.Jf)
		out = binary.NativeEndian.AppendUint32(out, ins.K)
	}
	return out, nil
}
