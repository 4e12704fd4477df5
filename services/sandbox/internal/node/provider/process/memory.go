package process

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// The sampling memory enforcer (DESIGN.md 3.3 "Limits per sandbox", host
// shape "neither"): where the service cannot make cgroups (a non-root
// service on cgroup v1, most Kubernetes pods), each live runtime key's
// processes — the same process tree discovery finds — are sampled every
// limits tick and summed; a key over its limit is stopped with
// memory_limit, as the cgroup path stops it. The limit bounds each runtime
// key, as a cgroup does where cgroups exist. Sampling is not a cap: a
// process may pass the limit between two samples (RLIMIT_AS still bounds
// each process).

// memWatch is the decision: samples in, breaches out. It holds, per
// sandbox, the keys already reported over the limit, so each passing is
// reported once until the key is under again or gone.
type memWatch struct {
	reported map[string]map[string]bool // sandbox → runtime key → reported
}

// observe takes one sandbox's complete sample (bytes per live runtime key)
// and returns the keys to stop, sorted. Keys missing from the sample are
// gone (stopped, or ended): forgotten, so a new launch is judged afresh.
// limit 0 is no limit.
func (w *memWatch) observe(sandboxID string, usage map[string]uint64, limit uint64) []string {
	if w.reported == nil {
		w.reported = map[string]map[string]bool{}
	}
	prev := w.reported[sandboxID]
	next := map[string]bool{}
	var out []string
	for key, used := range usage {
		if limit == 0 || used <= limit {
			continue
		}
		next[key] = true
		if !prev[key] {
			out = append(out, key)
		}
	}
	if len(next) == 0 {
		delete(w.reported, sandboxID)
	} else {
		w.reported[sandboxID] = next
	}
	sort.Strings(out)
	return out
}

// retain forgets the sandboxes not live any more.
func (w *memWatch) retain(live map[string]bool) {
	for sb := range w.reported {
		if !live[sb] {
			delete(w.reported, sb)
		}
	}
}

// sampleMemory sums the memory of each runtime key's processes in the
// sandbox (units found in one /proc table). A process whose memory cannot
// be read counts nothing (it exited, or hides its files: see procMemory).
func (p *Provider) sampleMemory(t *procTable, sandboxID string) (map[string]uint64, error) {
	records, err := p.records(sandboxID)
	if err != nil {
		return nil, err
	}
	us, err := units(t, p.scope, sandboxID, records)
	if err != nil {
		return nil, err
	}
	usage := map[string]uint64{}
	for _, u := range us {
		key, ok := keyOf(u)
		if !ok {
			continue
		}
		usage[key] += procMemory(p.cfg.ProcRoot, u.anchor.pid)
		for _, m := range u.members {
			usage[key] += procMemory(p.cfg.ProcRoot, m.pid)
		}
	}
	return usage, nil
}

// memoryBreaches is the sampled enforcer's part of OverLimit: every live
// sandbox's keys over the memory limit. A sandbox whose processes cannot be
// listed is not judged this tick (no sample is no verdict).
func (p *Provider) memoryBreaches(sandboxes []string) []provider.Breach {
	if p.cfg.Cgroups != nil || p.cfg.MemoryLimit == 0 {
		return nil
	}
	t, err := scanAll(p.cfg.ProcRoot)
	if err != nil {
		p.cfg.Logger.Warn("sandbox memory not sampled", "err", err)
		return nil
	}
	live := map[string]bool{}
	var out []provider.Breach
	for _, sb := range sandboxes {
		live[sb] = true
		usage, err := p.sampleMemory(t, sb)
		if err != nil {
			p.cfg.Logger.Warn("sandbox memory not sampled", "sandbox", sb, "err", err)
			continue
		}
		p.groups.mu.Lock()
		keys := p.groups.mem.observe(sb, usage, p.cfg.MemoryLimit)
		p.groups.mu.Unlock()
		for _, key := range keys {
			p.cfg.Logger.Warn("sandbox over its memory limit (sampled)", "sandbox", sb, "runtime_key", key,
				"bytes", usage[key], "limit", p.cfg.MemoryLimit)
			out = append(out, provider.Breach{SandboxID: sb, RuntimeKey: key, Reason: provider.ReasonMemoryLimit})
		}
	}
	p.groups.mu.Lock()
	p.groups.mem.retain(live)
	p.groups.mu.Unlock()
	return out
}

// procMemory is what one process holds, in bytes: its proportional set
// size (smaps_rollup Pss: shared pages divided among their users) where the
// service may read it, else its anonymous and shared-memory resident pages
// (status RssAnon + RssShmem: world-readable, also for a non-dumpable
// process; the host's shared libraries are not counted), else its resident
// pages less the file-backed shared ones (statm). 0 when none can be read.
func procMemory(procRoot string, pid int) uint64 {
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	if b, err := os.ReadFile(filepath.Join(dir, "smaps_rollup")); err == nil {
		if v, ok := kbField(b, "Pss:"); ok {
			return v
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "status")); err == nil {
		anon, ok1 := kbField(b, "RssAnon:")
		shmem, ok2 := kbField(b, "RssShmem:")
		if ok1 || ok2 {
			return anon + shmem
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "statm")); err == nil {
		f := strings.Fields(string(b))
		if len(f) >= 3 {
			res, err1 := strconv.ParseUint(f[1], 10, 64)
			shared, err2 := strconv.ParseUint(f[2], 10, 64)
			if err1 == nil && err2 == nil && res >= shared {
				return (res - shared) * uint64(os.Getpagesize())
			}
		}
	}
	return 0
}

// kbField reads a "Name:  N kB" line of a /proc file, in bytes.
func kbField(b []byte, name string) (uint64, bool) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), name)
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return 0, false
		}
		v, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0, false
		}
		return v << 10, true
	}
	return 0, false
}
