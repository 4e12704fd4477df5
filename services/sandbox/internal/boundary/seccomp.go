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
}

// SeccompProgram returns the filter as bubblewrap's --seccomp reads it: an
// array of struct sock_filter in host byte order. On a foreign architecture
// (a 32-bit ABI called from a 64-bit process) it kills the process rather
// than let a second syscall table bypass the list; clone3, whose flags a
// classic BPF filter cannot read, answers ENOSYS so libc falls back to
// clone, whose CLONE_NEWUSER flag the filter refuses.
func SeccompProgram() ([]byte, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w", err)
	}
	clone3, ok := info.SyscallNames["clone3"]
	if !ok {
		return nil, fmt.Errorf("seccomp: no clone3 on %s", info.Name)
	}
	policy := seccomp.Policy{
		DefaultAction: seccomp.ActionAllow,
		Syscalls: []seccomp.SyscallGroup{
			{Action: seccomp.ActionErrno, Names: refused},
			{Action: seccomp.ActionErrno, NamesWithCondtions: []seccomp.NameWithConditions{{
				Name:       "clone",
				Conditions: seccomp.ArgumentConditions{{Argument: 0, Operation: seccomp.BitsSet, Value: unix.CLONE_NEWUSER}},
			}}},
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
