package driver

import (
	"context"

	"agentplane.dev/services/sandbox/internal/capacity"
	"agentplane.dev/services/sandbox/internal/provider"
	"agentplane.dev/services/sandbox/internal/store"
)

// DESIGN.md 3.4 recovery of one sandbox (ENOSPC evidence or a failed
// directory setup): every wrapper of the sandbox is stopped, and its tree is
// deleted only once their absence is verified — a tree deleted under a
// running wrapper is a lie about what still runs and writes there. Until
// then the sandbox prepares no route (they wait, step wait_for_recovery).

// beginRecovery marks the sandbox recovering and requests a stop of every
// runtime key it knows; the tick finishes the recovery (checkRecovery).
func (d *Driver) beginRecovery(sb *sandbox, cause error) {
	sb.mu.Lock()
	if !sb.recovering {
		sb.recovering, sb.recoveryCause = true, cause
	}
	keys := make([]string, 0, len(sb.keyAllocations))
	for k := range sb.keyAllocations {
		keys = append(keys, k)
	}
	sb.mu.Unlock()
	for _, k := range keys {
		d.stopKey(sb, k, "sandbox_recovering")
	}
}

// checkRecovery deletes a recovering sandbox's tree once no wrapper of it
// can run: every runtime key verified absent (which drives their stops) and,
// where the provider can list the whole sandbox, nothing of it found. A
// route preparation still in flight postpones the deletion to the next tick.
func (d *Driver) checkRecovery(ctx context.Context, sb *sandbox) {
	sb.mu.Lock()
	if !sb.recovering {
		sb.mu.Unlock()
		return
	}
	keys := make([]string, 0, len(sb.keyAllocations))
	for k := range sb.keyAllocations {
		keys = append(keys, k)
	}
	cause := sb.recoveryCause
	sb.mu.Unlock()
	for _, k := range keys {
		if ok, _, err := d.cfg.Wrappers.AbsenceVerified(ctx, sb.id, k); err != nil || !ok {
			return
		}
	}
	if inv, ok := d.cfg.Provider.(provider.Inventory); ok {
		switch disc := inv.DiscoverSandbox(ctx, sb.id); disc.Kind {
		case provider.Absent:
		case provider.Present:
			for k := range disc.ByRuntimeKey {
				if k != "" { // unkeyed processes are the leak sweep's
					d.stopKey(sb, k, "sandbox_recovering")
				}
			}
			return
		default:
			return // could not look: never absence
		}
	}
	sb.mu.Lock()
	busy := len(sb.preparing) > 0
	sb.mu.Unlock()
	if busy {
		return
	}
	if _, err := capacity.Recover(ctx, d.cfg.Provider, sb.id, cause); err != nil {
		d.log.Warn("sandbox recovery failed; retried", "sandbox", sb.id, "err", err)
		return
	}
	d.log.Info("sandbox recovered: its wrappers verified absent, its tree deleted", "sandbox", sb.id)
	sb.mu.Lock()
	sb.recovering, sb.recoveryCause = false, nil
	var pending []string
	for id, r := range sb.routes {
		if r.State == store.RoutePreparing {
			pending = append(pending, id)
		}
	}
	sb.mu.Unlock()
	for _, id := range pending {
		d.startPreparing(sb, id)
	}
}
