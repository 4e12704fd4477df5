package driver

import (
	"context"

	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// StopOverLimit stops a runtime key of an owned sandbox that passed one of
// its limits (provider.ReasonMemoryLimit, provider.ReasonDiskQuota), as a
// timer-driven stop does: its routes are lost (a route still preparing
// fails) with reason, and its wrappers are asked to stop. It reports
// whether a stop began (false: not owned here, or the key is not live).
func (d *Driver) StopOverLimit(ctx context.Context, sandboxID, key, reason string) bool {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb == nil {
		return false
	}
	sb.mu.Lock()
	s := sb.keyAllocations[key]
	if sb.dropped || s == nil || !s.Alloc.Live() {
		sb.mu.Unlock()
		return false
	}
	before := s.Alloc
	s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Stop{Now: d.cfg.Now(), Reason: reason})
	d.persistAllocations(sb, []*store.KeyAllocation{s})
	ch := keyChange{key: key, instance: before.Instance, from: before, to: s.Alloc, conn: sb.conns[key]}
	sb.mu.Unlock()
	d.stopping(ctx, sb, ch)
	return true
}
