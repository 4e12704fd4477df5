package process

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"

	"agentplane.dev/services/sandbox/internal/cgroup"
	"agentplane.dev/services/sandbox/internal/provider"
)

// groups are the cgroups of this provider's live runtime keys, by name,
// with what each counted so far (an OOM kill is reported once).
type groups struct {
	mu   sync.Mutex
	live map[string]*liveGroup
}

type liveGroup struct {
	g         *cgroup.Group
	markers   provider.Markers
	users     int    // launches of the key whose namespace still runs
	events    uint64 // memory events reported so far
}

// groupName is a runtime key's cgroup: one per deployment, sandbox and key.
func (p *Provider) groupName(m provider.Markers) string {
	sum := sha256.Sum256([]byte(p.cfg.Deployment + "\x00" + m.SandboxID + "\x00" + m.RuntimeKey))
	return "rk-" + hex.EncodeToString(sum[:10])
}

// enterGroup puts a launched bubblewrap (pid) and its namespace's init in
// the runtime key's cgroup, then lets bubblewrap go on (it waits on its
// block fd before it runs anything of the sandbox). Everything the wrapper
// and the runtime start is created inside the group.
func (p *Provider) enterGroup(m provider.Markers, pid int, f *launchFiles) (string, error) {
	if p.cfg.Cgroups == nil || f == nil || f.blockW == nil {
		return "", nil
	}
	defer f.blockW.Close()
	name := p.groupName(m)
	g, err := p.cfg.Cgroups.Create(name, p.cfg.CgroupLimits)
	if err != nil {
		return "", fmt.Errorf("process provider: sandbox cgroup: %w", err)
	}
	child := f.childPID()
	if child <= 0 {
		return "", fmt.Errorf("process provider: bubblewrap named no child before it ran")
	}
	for _, x := range []int{pid, child} {
		if err := g.Add(x); err != nil {
			return "", fmt.Errorf("process provider: %w", err)
		}
	}
	p.groups.mu.Lock()
	if p.groups.live == nil {
		p.groups.live = map[string]*liveGroup{}
	}
	lg := p.groups.live[name]
	if lg == nil {
		lg = &liveGroup{g: g, markers: provider.Markers{SandboxID: m.SandboxID, RuntimeKey: m.RuntimeKey}}
		lg.events, _ = g.MemoryEvents() // a reused group's earlier events are not this launch's
		p.groups.live[name] = lg
	}
	lg.users++
	p.groups.mu.Unlock()
	if _, err := f.blockW.Write([]byte{1}); err != nil {
		return "", fmt.Errorf("process provider: release bubblewrap: %w", err)
	}
	return name, nil
}

// leaveGroup removes a launch's group once its namespace is gone and no
// other launch of the key uses it.
func (p *Provider) leaveGroup(name string) {
	if name == "" {
		return
	}
	p.groups.mu.Lock()
	defer p.groups.mu.Unlock()
	lg := p.groups.live[name]
	if lg == nil {
		return
	}
	if lg.users--; lg.users > 0 {
		return
	}
	delete(p.groups.live, name)
	if err := lg.g.Remove(); err != nil {
		p.cfg.Logger.Warn("sandbox cgroup not removed", "group", name, "err", err)
	}
}

// OverLimit lists the runtime keys whose cgroup reached its memory limit
// since the last call: each is stopped with provider.ReasonMemoryLimit.
func (p *Provider) OverLimit() []provider.Breach {
	p.groups.mu.Lock()
	defer p.groups.mu.Unlock()
	var out []provider.Breach
	for _, lg := range p.groups.live {
		n, err := lg.g.MemoryEvents()
		if err != nil || n <= lg.events {
			continue
		}
		lg.events = n
		out = append(out, provider.Breach{SandboxID: lg.markers.SandboxID, RuntimeKey: lg.markers.RuntimeKey, Reason: provider.ReasonMemoryLimit})
	}
	return out
}
