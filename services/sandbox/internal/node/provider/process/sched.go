package process

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Scheduling weight without cgroups (DESIGN.md 3.3 "Limits per sandbox",
// host shape "neither"; decision 62): bubblewrap and its namespace's init
// get SCHED_BATCH and the configured nice value while they wait on the
// block fd, before anything of the sandbox runs; every process of the
// sandbox inherits both. An unprivileged process cannot lower its nice
// value again (RLIMIT_NICE is 0 and the sandbox holds no CAP_SYS_NICE in
// the host's user namespace). This is weighting, not a cap: an otherwise
// idle node still gives a sandbox every core; a busy one gives the
// services and other agents (nice 0) about 10× a nice-10 thread's share.

// weigh sets the sandbox's scheduling weight on bubblewrap (pid) and its
// namespace's init, then lets bubblewrap go on.
func (p *Provider) weigh(pid int, f *launchFiles) error {
	defer f.blockW.Close()
	child := f.childPID()
	if child <= 0 {
		return fmt.Errorf("process provider: bubblewrap named no child before it ran")
	}
	for _, x := range []int{pid, child} {
		if err := setWeight(x, p.cfg.Nice); err != nil {
			return fmt.Errorf("process provider: scheduling weight of pid %d: %w", x, err)
		}
	}
	if _, err := f.blockW.Write([]byte{1}); err != nil {
		return fmt.Errorf("process provider: release bubblewrap: %w", err)
	}
	return nil
}

// setWeight gives one (single-threaded) process SCHED_BATCH at nice.
func setWeight(pid, nice int) error {
	attr := &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_BATCH, Nice: int32(nice)}
	return unix.SchedSetAttr(pid, attr, 0)
}
