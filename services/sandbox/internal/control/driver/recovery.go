package driver

import (
	"context"

	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// DESIGN.md 3.4 recovery, as amended by issue 33: ENOSPC evidence or a
// failed directory setup recovers the failed route's runtime key only. Its
// wrappers are stopped, and once their absence is verified the provider
// removes what of that key is verifiably recreatable (an empty workspace
// no other key uses, a home holding only its record); a workspace with
// anything in it may hold changes not pushed or exported, so it is kept
// and reported. Other runtime keys of the sandbox, and their workspaces,
// are never touched: a full disk is rarely the sandbox's doing (inodes
// taken by files outside the tree), and deleting users' work frees
// nothing that matters. Until the key's recovery ends its routes are not
// prepared (they wait, step wait_for_recovery).

// keyRecovery is one runtime key's recovery in progress.
type keyRecovery struct {
	directory string
	cause     error
}

// beginRecovery marks the failed route's runtime key recovering and
// requests a stop of its wrappers; the tick finishes the recovery
// (checkRecovery).
func (d *Driver) beginRecovery(sb *sandbox, sessionID string, cause error) {
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil {
		sb.mu.Unlock()
		return
	}
	key := r.RuntimeKey
	if key == "" {
		key = scope.RuntimeKey(sb.scopeLocked(r.Directory).Contract, r.Directory, sessionID)
	}
	if sb.recovering == nil {
		sb.recovering = map[string]*keyRecovery{}
	}
	if sb.recovering[key] == nil {
		sb.recovering[key] = &keyRecovery{directory: r.Directory, cause: cause}
	}
	sb.mu.Unlock()
	d.log.Warn("runtime key recovery: stopping its wrappers, then removing only what is recreatable",
		"sandbox", sb.id, "session", sessionID, "runtime_key", key, "err", cause)
	d.stopKey(sb, key, "sandbox_recovering")
}

// checkRecovery finishes each recovering runtime key of the sandbox whose
// wrappers are verified absent: where the provider can list the whole
// sandbox, no process of the key may be found either; a route preparation
// of the key still in flight postpones it to the next tick.
func (d *Driver) checkRecovery(ctx context.Context, sb *sandbox) {
	sb.mu.Lock()
	pending := make(map[string]keyRecovery, len(sb.recovering))
	for k, rec := range sb.recovering {
		pending[k] = *rec
	}
	sb.mu.Unlock()
	if len(pending) == 0 {
		return
	}
	var disc provider.SandboxDiscovery
	inv, canList := d.cfg.Provider.(provider.Inventory)
	if canList {
		disc = inv.DiscoverSandbox(ctx, sb.id)
		if disc.Kind != provider.Absent && disc.Kind != provider.Present {
			return // could not look: never absence
		}
	}
	for key, rec := range pending {
		if ok, _, err := d.cfg.Wrappers.AbsenceVerified(ctx, sb.id, key); err != nil || !ok {
			continue
		}
		if len(disc.ByRuntimeKey[key]) > 0 {
			d.stopKey(sb, key, "sandbox_recovering")
			continue
		}
		d.finishRecovery(ctx, sb, key, rec)
	}
}

// finishRecovery removes what of the key is recreatable, reports what it
// kept, and prepares the key's waiting routes again.
func (d *Driver) finishRecovery(ctx context.Context, sb *sandbox, key string, rec keyRecovery) {
	sb.mu.Lock()
	shared := false
	for id, r := range sb.routes {
		if r.RuntimeKey == key && sb.preparing[id] {
			sb.mu.Unlock()
			return
		}
		if r.Directory == rec.directory && r.RuntimeKey != key && r.State != store.RouteReleased {
			shared = true
		}
	}
	for k, s := range sb.keyAllocations {
		if k != key && s.Directory == rec.directory {
			shared = true // another key of the directory (per_session) uses the workspace
		}
	}
	sb.mu.Unlock()
	recreated := false
	if kr, ok := d.cfg.Provider.(provider.KeyRecoverer); ok {
		got, err := kr.RecoverKey(ctx, sb.id, key, rec.directory, shared)
		if err != nil {
			d.log.Warn("runtime key recovery failed; retried", "sandbox", sb.id, "runtime_key", key, "err", err)
			return
		}
		if got.KeptWorkspace {
			d.Metrics.RecoveryKeptWorkspaces.Add(1)
			d.log.Warn("runtime key recovery kept the workspace: it holds files that may be changes not pushed or exported",
				"sandbox", sb.id, "runtime_key", key, "directory", rec.directory, "cause", rec.cause)
		}
		d.log.Warn("runtime key recovered: its wrappers verified absent", "sandbox", sb.id, "runtime_key", key,
			"removed", got.Removed, "kept_workspace", got.KeptWorkspace, "kept_home", got.KeptHome, "workspace_shared", shared)
		recreated = len(got.Removed) > 0
	}
	sb.mu.Lock()
	delete(sb.recovering, key)
	if recreated {
		// What went was recreatable: the key's routes resume without
		// reading its absence as resume_state_lost.
		for _, r := range sb.routes {
			if r.RuntimeKey == key {
				d.applyLocked(sb, r, route.Recreated{})
			}
		}
	}
	var waiting []string
	for id, r := range sb.routes {
		if r.State == store.RoutePreparing && (r.RuntimeKey == key || r.RuntimeKey == "") {
			waiting = append(waiting, id)
		}
	}
	sb.mu.Unlock()
	for _, id := range waiting {
		d.startPreparing(sb, id)
	}
}
