// Package nodump marks the running process non-dumpable, the first thing every agentplane
// service does at start.
//
// A non-dumpable process (prctl PR_SET_DUMPABLE 0) writes no core dump, and the kernel
// refuses ptrace and the ptrace-guarded /proc files (environ, mem, maps, fd, ...) to every
// other process, even one of the same uid, unless it holds CAP_SYS_PTRACE. So code running as
// the service's uid outside any sandbox cannot lift the internal token, the Redis password or
// the credential keys from the service's environment or memory. The flag is reset by execve,
// so the wrappers a sandbox service starts stay readable to it (discovery reads their
// /proc/<pid>/environ).
package nodump

// Set marks this process non-dumpable.
func Set() error { return set() }

// Dumpable reports whether this process is dumpable (false after Set).
func Dumpable() (bool, error) { return dumpable() }
