package driver

import (
	"context"
	"maps"
	"slices"

	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// owned returns the sandboxes this replica drives now (a copy: callers
// work on them without holding d.mu).
func (d *Driver) owned() []*sandbox {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Collect(maps.Values(d.sandboxes))
}

// tick applies the allocation timers of every owned sandbox.
func (d *Driver) tick(ctx context.Context) {
	for _, sb := range d.owned() {
		d.tickSandbox(ctx, sb)
	}
}

type keyChange struct {
	key, instance string
	from, to      allocation.Allocation
	conn          *Conn
}

func (d *Driver) tickSandbox(ctx context.Context, sb *sandbox) {
	now := d.cfg.Now()
	sb.mu.Lock()
	if sb.dropped {
		sb.mu.Unlock()
		return
	}
	var changes []keyChange
	var changed []*store.KeyAllocation
	var disconnected []string
	for key, s := range sb.keyAllocations {
		before := s.Alloc
		s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Tick{Now: now})
		if s.Alloc.Phase == allocation.Disconnected || s.Alloc.Phase == allocation.Starting && sb.launching[key] == 0 {
			disconnected = append(disconnected, key)
		}
		if s.Alloc.Phase != before.Phase {
			changes = append(changes, keyChange{key: key, instance: before.Instance, from: before, to: s.Alloc, conn: sb.conns[key]})
			changed = append(changed, s)
		}
	}
	if len(changed) > 0 {
		d.persistAllocations(sb, changed)
	}
	sb.mu.Unlock()

	for _, ch := range changes {
		switch {
		case ch.to.Phase == allocation.Disconnected:
			// Heartbeats stopped: the stream is dead even if TCP says otherwise.
			if ch.conn != nil {
				d.Disconnected(ch.conn)
			}
		case ch.to.Phase == allocation.Stopping:
			d.stopping(ctx, sb, ch)
		}
	}
	// A disconnected wrapper that verifiably no longer runs is lost now;
	// waiting out the reconnect window would only delay the session. So is
	// a starting one no launch here is making that no longer runs (or never
	// did: a pooled wrapper ends when its service dies before its claim
	// reached it), rather than after the whole Hello timeout.
	for _, key := range disconnected {
		d.checkGone(ctx, sb, key)
	}
	d.checkStopped(ctx, sb)
	d.checkRecovery(ctx, sb)
	d.retryMemberReleases(sb)
	d.releaseIfEmpty(ctx, sb)
}

// stopping handles a timer-driven stop: routes of the key are lost (or fail
// when they never became ready) and the wrapper lease is asked to stop.
func (d *Driver) stopping(ctx context.Context, sb *sandbox, ch keyChange) {
	reason := ch.to.Reason
	sb.mu.Lock()
	var lost, failed []string
	for id, r := range sb.routes {
		// A route that never became ready fails after the stop request
		// (failRoute); the others are lost now.
		if r.RuntimeKey == ch.key && r.State == store.RoutePreparing {
			failed = append(failed, id)
			continue
		}
		if eff := d.applyLocked(sb, r, route.WrapperStopping{RuntimeKey: ch.key, Reason: reason}); eff.Notify == route.NoticeLost {
			lost = append(lost, id)
		}
	}
	sb.mu.Unlock()
	if ch.conn != nil {
		ch.conn.send(stopRequested(reason))
	}
	if err := d.cfg.Wrappers.RequestStop(ctx, sb.id, ch.key, reason); err != nil {
		d.log.Warn("request stop failed", "sandbox", sb.id, "runtime_key", ch.key, "err", err)
	}
	for _, id := range lost {
		d.cfg.Notifier.Lost(d.ref(sb, id), reason)
	}
	for _, id := range failed {
		d.failRoute(sb, id, reason, true)
	}
}

// checkGone declares a disconnected wrapper lost once discovery shows its
// instance is not running (never on an inspection failure).
func (d *Driver) checkGone(ctx context.Context, sb *sandbox, key string) {
	sb.mu.Lock()
	s := sb.keyAllocations[key]
	gone := func() bool {
		return s.Alloc.Phase == allocation.Disconnected || s.Alloc.Phase == allocation.Starting && sb.launching[key] == 0
	}
	if s == nil || !gone() {
		sb.mu.Unlock()
		return
	}
	instance, phase := s.Alloc.Instance, s.Alloc.Phase
	sb.mu.Unlock()
	disc := d.cfg.Provider.Discover(ctx, sb.id, key)
	if disc.Kind == provider.InspectionFailed {
		return
	}
	for _, o := range disc.Observed {
		if o.InstanceID == instance {
			return
		}
	}
	now := d.cfg.Now()
	sb.mu.Lock()
	if !gone() || s.Alloc.Phase != phase || s.Alloc.Instance != instance {
		sb.mu.Unlock()
		return
	}
	reason := s.Alloc.Reason
	if reason == allocation.ReasonStreamClosed || phase == allocation.Starting {
		reason = "wrapper_exited"
	}
	s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Stop{Now: now, Reason: reason})
	d.persistAllocations(sb, []*store.KeyAllocation{s})
	var lost []string
	for id, r := range sb.routes {
		if eff := d.applyLocked(sb, r, route.WrapperGone{RuntimeKey: key, Reason: reason}); eff.Notify == route.NoticeLost {
			lost = append(lost, id)
		}
	}
	sb.mu.Unlock()
	d.log.Info("wrapper gone", "sandbox", sb.id, "runtime_key", key, "instance", instance, "was", string(phase), "reason", reason)
	if err := d.cfg.Wrappers.WrapperGone(ctx, sb.id, key, instance); err != nil {
		d.log.Warn("wrapper gone not recorded", "sandbox", sb.id, "runtime_key", key, "err", err)
	}
	for _, id := range lost {
		d.cfg.Notifier.Lost(d.ref(sb, id), reason)
	}
}

// checkStopped moves stopping key allocations to stopped once the lease reports the
// runtime key's absence.
func (d *Driver) checkStopped(ctx context.Context, sb *sandbox) {
	sb.mu.Lock()
	var keys []string
	for key, s := range sb.keyAllocations {
		if s.Alloc.Phase == allocation.Stopping {
			keys = append(keys, key)
		}
	}
	sb.mu.Unlock()
	for _, key := range keys {
		ok, _, err := d.cfg.Wrappers.AbsenceVerified(ctx, sb.id, key)
		if err != nil || !ok {
			continue
		}
		sb.mu.Lock()
		if s := sb.keyAllocations[key]; s != nil && s.Alloc.Phase == allocation.Stopping {
			s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.StopVerified{Now: d.cfg.Now()})
			d.persistAllocations(sb, []*store.KeyAllocation{s})
			var pending []string
			for id, r := range sb.routes {
				if _, eff := route.Apply(r.Route, route.KeyStopped{}); eff.StartPreparing && !sb.preparing[id] {
					pending = append(pending, id)
				}
			}
			sb.mu.Unlock()
			for _, id := range pending {
				d.startPreparing(sb, id)
			}
			continue
		}
		sb.mu.Unlock()
	}
}
