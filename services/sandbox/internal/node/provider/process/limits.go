package process

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"agentplane.dev/services/sandbox/internal/node/cgroup"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// groups are this provider's live launches: each runtime key's cgroup by
// name (with the memory events reported so far), and each sandbox's
// launched keys with its sampled disk usage.
type groups struct {
	mu   sync.Mutex
	live map[string]*liveGroup
	keys map[string]map[string]int // sandbox → runtime key → launches whose namespace runs
	disk map[string]*diskSample    // sandbox → its last usage sample
	mem  memWatch                  // the sampled memory limit (memory.go)
}

type liveGroup struct {
	g       *cgroup.Group
	markers provider.Markers
	users   int    // launches of the key whose namespace still runs
	events  uint64 // memory events reported so far
}

type diskSample struct {
	bytes    uint64
	at       time.Time
	reported bool // disk_quota was reported for this sandbox's live keys
}

// diskEvery is how often a sandbox's disk usage is sampled (a walk of its
// directory).
const diskEvery = 5 * time.Second

// launchRec is what leaveGroup undoes.
type launchRec struct {
	m     provider.Markers
	group string // "" without a cgroup
}

// groupName is a runtime key's cgroup: one per deployment, sandbox and key.
func (p *Provider) groupName(m provider.Markers) string {
	sum := sha256.Sum256([]byte(p.cfg.Deployment + "\x00" + m.SandboxID + "\x00" + m.RuntimeKey))
	return "rk-" + hex.EncodeToString(sum[:10])
}

// enterGroup records a launch and, with cgroups, puts the launched
// bubblewrap (pid) and its namespace's init in the runtime key's cgroup,
// then lets bubblewrap go on (it waits on its block fd before it runs
// anything of the sandbox). Everything the wrapper and the runtime start
// is created inside the group.
func (p *Provider) enterGroup(m provider.Markers, pid int, f *launchFiles) (launchRec, error) {
	l := launchRec{m: provider.Markers{SandboxID: m.SandboxID, RuntimeKey: m.RuntimeKey}}
	if p.cfg.Cgroups == nil && f != nil && f.blockW != nil {
		if err := p.weigh(pid, f); err != nil {
			return launchRec{}, err
		}
	}
	if p.cfg.Cgroups != nil && f != nil && f.blockW != nil {
		defer f.blockW.Close()
		name := p.groupName(m)
		g, err := p.cfg.Cgroups.Create(name, p.cfg.CgroupLimits)
		if err != nil {
			return launchRec{}, fmt.Errorf("process provider: sandbox cgroup: %w", err)
		}
		child := f.childPID()
		if child <= 0 {
			return launchRec{}, fmt.Errorf("process provider: bubblewrap named no child before it ran")
		}
		for _, x := range []int{pid, child} {
			if err := g.Add(x); err != nil {
				return launchRec{}, fmt.Errorf("process provider: %w", err)
			}
		}
		p.groups.mu.Lock()
		if p.groups.live == nil {
			p.groups.live = map[string]*liveGroup{}
		}
		lg := p.groups.live[name]
		if lg == nil {
			lg = &liveGroup{g: g, markers: l.m}
			lg.events, _ = g.MemoryEvents() // a reused group's earlier events are not this launch's
			p.groups.live[name] = lg
		}
		lg.users++
		p.groups.mu.Unlock()
		l.group = name
		if _, err := f.blockW.Write([]byte{1}); err != nil {
			p.leaveGroup(l)
			return launchRec{}, fmt.Errorf("process provider: release bubblewrap: %w", err)
		}
	}
	p.groups.mu.Lock()
	if p.groups.keys == nil {
		p.groups.keys = map[string]map[string]int{}
	}
	if p.groups.keys[m.SandboxID] == nil {
		p.groups.keys[m.SandboxID] = map[string]int{}
	}
	p.groups.keys[m.SandboxID][m.RuntimeKey]++
	p.groups.mu.Unlock()
	return l, nil
}

// relabel moves a launch's accounting to the runtime key m that claimed it
// (pool.go): its disk sampling, and its cgroup's breaches, are m's now. The
// cgroup keeps its name; a later launch of m makes m's own.
func (p *Provider) relabel(l launchRec, m provider.Markers) launchRec {
	p.groups.mu.Lock()
	defer p.groups.mu.Unlock()
	to := provider.Markers{SandboxID: m.SandboxID, RuntimeKey: m.RuntimeKey}
	if ks := p.groups.keys[l.m.SandboxID]; ks != nil {
		if ks[l.m.RuntimeKey]--; ks[l.m.RuntimeKey] <= 0 {
			delete(ks, l.m.RuntimeKey)
		}
		if len(ks) == 0 {
			delete(p.groups.keys, l.m.SandboxID)
		}
	}
	if p.groups.keys[to.SandboxID] == nil {
		p.groups.keys[to.SandboxID] = map[string]int{}
	}
	p.groups.keys[to.SandboxID][to.RuntimeKey]++
	if lg := p.groups.live[l.group]; l.group != "" && lg != nil {
		lg.markers = to
	}
	return launchRec{m: to, group: l.group}
}

// leaveGroup forgets a launch once its namespace is gone, and removes its
// group when no other launch of the key uses it.
func (p *Provider) leaveGroup(l launchRec) {
	p.groups.mu.Lock()
	defer p.groups.mu.Unlock()
	if ks := p.groups.keys[l.m.SandboxID]; ks != nil {
		if ks[l.m.RuntimeKey]--; ks[l.m.RuntimeKey] <= 0 {
			delete(ks, l.m.RuntimeKey)
		}
		if len(ks) == 0 {
			delete(p.groups.keys, l.m.SandboxID)
		}
	}
	lg := p.groups.live[l.group]
	if l.group == "" || lg == nil {
		return
	}
	if lg.users--; lg.users > 0 {
		return
	}
	delete(p.groups.live, l.group)
	if err := lg.g.Remove(); err != nil {
		p.cfg.Logger.Warn("sandbox cgroup not removed", "group", l.group, "err", err)
	}
}

// OverLimit lists the runtime keys that passed a limit since the last
// call: a cgroup that reached its memory limit (provider.ReasonMemoryLimit)
// and every live key of a sandbox over its disk quota
// (provider.ReasonDiskQuota). Without cgroups, a key whose sampled memory
// passed the limit (memory.go) is provider.ReasonMemoryLimit too.
func (p *Provider) OverLimit() []provider.Breach {
	var out []provider.Breach
	p.groups.mu.Lock()
	for _, lg := range p.groups.live {
		n, err := lg.g.MemoryEvents()
		if err != nil || n <= lg.events {
			continue
		}
		lg.events = n
		out = append(out, provider.Breach{SandboxID: lg.markers.SandboxID, RuntimeKey: lg.markers.RuntimeKey, Reason: provider.ReasonMemoryLimit})
	}
	sandboxes := make([]string, 0, len(p.groups.keys))
	for sb := range p.groups.keys {
		sandboxes = append(sandboxes, sb)
	}
	p.groups.mu.Unlock()
	out = append(out, p.memoryBreaches(sandboxes)...)
	if p.cfg.DiskQuota == 0 {
		return out
	}
	for _, sb := range sandboxes {
		used, ok := p.sampleDisk(sb, false)
		if !ok || used < p.cfg.DiskQuota {
			continue
		}
		p.groups.mu.Lock()
		s := p.groups.disk[sb]
		if s != nil && !s.reported {
			s.reported = true
			for key := range p.groups.keys[sb] {
				out = append(out, provider.Breach{SandboxID: sb, RuntimeKey: key, Reason: provider.ReasonDiskQuota})
			}
		}
		p.groups.mu.Unlock()
	}
	return out
}

// sampleDisk returns the sandbox's disk usage, walking its directory when
// the last sample is older than diskEvery (or fresh is set).
func (p *Provider) sampleDisk(sandboxID string, fresh bool) (uint64, bool) {
	now := time.Now()
	p.groups.mu.Lock()
	if p.groups.disk == nil {
		p.groups.disk = map[string]*diskSample{}
	}
	s := p.groups.disk[sandboxID]
	if s != nil && !fresh && now.Sub(s.at) < diskEvery {
		used := s.bytes
		p.groups.mu.Unlock()
		return used, true
	}
	p.groups.mu.Unlock()
	used, err := dirUsage(p.SandboxDir(sandboxID))
	if err != nil {
		return 0, false
	}
	p.groups.mu.Lock()
	if s = p.groups.disk[sandboxID]; s == nil {
		s = &diskSample{}
		p.groups.disk[sandboxID] = s
	}
	s.bytes, s.at = used, now
	if used < p.cfg.DiskQuota {
		s.reported = false // under again (files removed): a later breach is reported anew
	}
	p.groups.mu.Unlock()
	return used, true
}

// dirUsage is the disk a directory tree uses (allocated blocks, so sparse
// files count what they hold).
func dirUsage(dir string) (uint64, error) {
	var total uint64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil // vanished or unreadable: counted as nothing
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			total += uint64(st.Blocks) * 512
		}
		return nil
	})
	return total, err
}

// CheckQuota is provider.ErrDiskQuota when the sandbox uses its whole
// disk quota (measured now): its routes fail with disk_quota.
func (p *Provider) CheckQuota(sandboxID string) error {
	if p.cfg.DiskQuota == 0 {
		return nil
	}
	used, ok := p.sampleDisk(sandboxID, true)
	if ok && used >= p.cfg.DiskQuota {
		return fmt.Errorf("%w: sandbox %s uses %d bytes of its %d", provider.ErrDiskQuota, sandboxID, used, p.cfg.DiskQuota)
	}
	return nil
}

// Reserved is what the live sandboxes other than except may still write
// within their quotas: admission counts it as used.
func (p *Provider) Reserved(except string) uint64 {
	if p.cfg.DiskQuota == 0 {
		return 0
	}
	p.groups.mu.Lock()
	var sbs []string
	for sb := range p.groups.keys {
		if sb != except {
			sbs = append(sbs, sb)
		}
	}
	p.groups.mu.Unlock()
	var total uint64
	for _, sb := range sbs {
		used, _ := p.sampleDisk(sb, false)
		if used < p.cfg.DiskQuota {
			total += p.cfg.DiskQuota - used
		}
	}
	return total
}
