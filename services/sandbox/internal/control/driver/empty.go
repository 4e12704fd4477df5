package driver

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/leasestore"
	"agentplane.dev/services/sandbox/internal/control/ownership"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// ErrSandboxEmpty is why a replica let go of a sandbox with nothing to drive.
var ErrSandboxEmpty = errors.New("the sandbox has no session left")

// ownStored returns the sandbox for a call that only talks to a route
// (Deliver, Abort, UpdateEgress, Route, handle and worktree calls): the one
// this replica drives, or, when the sandbox has stored routes and no live
// owner, the one it takes over (that owner died). A sandbox with no stored
// route is not acquired (issue 33 item 4): the call answers ErrRouteNotFound,
// or names the replica that holds it. A replica so never takes a sandbox
// over, with its owner lease, renewals and goroutines, because a caller asked
// about an id.
func (d *Driver) ownStored(ctx context.Context, id string) (*sandbox, error) {
	d.mu.Lock()
	sb := d.sandboxes[id]
	d.mu.Unlock()
	if sb != nil {
		return sb, nil
	}
	n, err := d.cfg.Redis.Exists(ctx, store.Key(id, "routes")).Result()
	if err != nil {
		return nil, err
	}
	if n > 0 {
		return d.own(ctx, id)
	}
	h, _, err := ownership.CurrentHolder(ctx, d.cfg.Redis, id)
	if err == nil && h.Replica != "" && h.Replica != d.cfg.ReplicaID {
		return nil, &OwnedElsewhereError{Owner: h}
	}
	return nil, ErrRouteNotFound
}

// OwnedCount is the number of sandboxes this replica drives now.
func (d *Driver) OwnedCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.sandboxes)
}

// UnconfirmedCount is the number of owned sandboxes whose owner lease is
// past its deadline without a confirmed renewal.
func (d *Driver) UnconfirmedCount() int {
	n := 0
	for _, sb := range d.owned() {
		if sb.owner.Unconfirmed() {
			n++
		}
	}
	return n
}

// emptyLocked reports whether sb has nothing in memory to drive: no route,
// no runtime key, no wrapper stream, no preparation, no recovery and no
// member release pending. The caller holds sb.mu.
func (sb *sandbox) emptyLocked() bool {
	return !sb.dropped && len(sb.routes) == 0 && len(sb.keyAllocations) == 0 && len(sb.conns) == 0 &&
		len(sb.preparing) == 0 && len(sb.recovering) == 0 && !sb.memberRetrying
}

// releaseIfEmpty lets go of a sandbox that has been empty for EmptyGrace
// (the tick calls it): its last session is gone, the reconciler tracks no
// wrapper lease of it and no process of it runs. Its tree goes from disk,
// its records, tenant binding and fencing token from Redis, it leaves
// sbx:index, and the owner lease is released, so a replica holds only
// sandboxes with something to drive and nothing of a sandbox outlives its
// last session (issue 32). Anything short of that certainty (a lease
// record left, a stored route, an inspection that failed) keeps the
// sandbox.
func (d *Driver) releaseIfEmpty(ctx context.Context, sb *sandbox) {
	d.forgetLeftoverKeys(ctx, sb)
	now := d.cfg.Now()
	sb.mu.Lock()
	if !sb.emptyLocked() {
		sb.emptySince = time.Time{}
		sb.mu.Unlock()
		return
	}
	if sb.emptySince.IsZero() {
		sb.emptySince = now
	}
	due := now.Sub(sb.emptySince) >= d.cfg.EmptyGrace
	sb.mu.Unlock()
	if !due {
		return
	}
	if n, err := d.cfg.Redis.HLen(ctx, leasestore.Key(ownership.Resource(sb.id))).Result(); err != nil || n > 0 {
		return
	}
	if n, err := d.cfg.Redis.HLen(ctx, store.Key(sb.id, "routes")).Result(); err != nil || n > 0 {
		return
	}
	if inv, ok := d.cfg.Provider.(provider.Inventory); ok {
		if disc := inv.DiscoverSandbox(ctx, sb.id); disc.Kind != provider.Absent {
			return
		}
	}
	d.letGo(ctx, sb)
}

// letGo deletes an empty sandbox's tree, its records, tenant binding and
// fencing token, takes it out of sbx:index and releases its owner lease, in
// that order: the tree and the index entry go while this replica still
// holds the lease, so it never removes those of a replica that acquires the
// sandbox next (which makes the tree again). A tree that could not be
// removed keeps the tenant binding: whatever is left on disk stays its
// tenant's. The fencing token may go: tokens are floored by Redis TIME, so
// the next owner's still exceeds every earlier one, and a guarded write
// with a token Redis no longer holds is refused.
func (d *Driver) letGo(ctx context.Context, sb *sandbox) {
	d.mu.Lock()
	sb.mu.Lock()
	if !sb.emptyLocked() || d.sandboxes[sb.id] != sb {
		sb.mu.Unlock()
		d.mu.Unlock()
		return
	}
	// Out of the map first: a Prepare from now on acquires anew, one that
	// already holds sb sees it dropped.
	delete(d.sandboxes, sb.id)
	sb.dropped = true
	sb.mu.Unlock()
	d.mu.Unlock()
	keys := []string{store.Key(sb.id, "meta"), store.Key(sb.id, "routes"), store.Key(sb.id, "scopes"),
		store.Key(sb.id, "wrappers"), store.Key(sb.id, "slots")}
	if err := d.cfg.Provider.Delete(ctx, sb.id, "", provider.DeleteReleased); err != nil {
		d.log.Warn("tree of an empty sandbox not removed", "sandbox", sb.id, "err", err)
	} else {
		keys = append(keys, store.Key(sb.id, "tenant"))
	}
	keys = append(keys, fence.TokenKey(ownership.Resource(sb.id)))
	err := sb.owner.Guard(ctx, fence.Del(keys...))
	if err == nil {
		err = d.cfg.Redis.SRem(ctx, store.IndexKey, sb.id).Err()
	}
	if err == nil {
		err = sb.owner.Release(ctx)
	}
	if err != nil {
		d.log.Warn("empty sandbox not fully released", "sandbox", sb.id, "err", err)
	}
	d.cfg.Wrappers.Forget(sb.id)
	sb.stop()
	d.log.Info("stopped driving sandbox", "sandbox", sb.id, "why", ErrSandboxEmpty.Error())
}

// forgetLeftoverKeys finishes the runtime keys a sandbox with no route and
// no preparation still has: a release forgets its key only when it verified
// the key's absence then (best effort), so a key whose wrapper was still
// live, or whose records a failed write kept, would hold the sandbox for
// good. Such a key gets a stop (its allocation and its wrapper lease), and
// once its absence is verified its records go (forgetKey).
func (d *Driver) forgetLeftoverKeys(ctx context.Context, sb *sandbox) {
	sb.mu.Lock()
	if sb.dropped || len(sb.routes) > 0 || len(sb.preparing) > 0 || len(sb.recovering) > 0 || len(sb.keyAllocations) == 0 {
		sb.mu.Unlock()
		return
	}
	dirs := map[string]string{}
	var stop []string
	for key, s := range sb.keyAllocations {
		dirs[key] = s.Directory
		if s.Alloc.Live() {
			s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Stop{Now: d.cfg.Now(), Reason: "no_session"})
			d.persistAllocations(sb, []*store.KeyAllocation{s})
			stop = append(stop, key)
		}
	}
	sb.mu.Unlock()
	for _, key := range stop {
		if err := d.cfg.Wrappers.RequestStop(ctx, sb.id, key, "no_session"); err != nil {
			d.log.Warn("stop of a runtime key with no session not requested", "sandbox", sb.id, "runtime_key", key, "err", err)
		}
	}
	for key, dir := range dirs {
		if ok, _, err := d.cfg.Wrappers.AbsenceVerified(ctx, sb.id, key); err == nil && ok {
			d.forgetKey(ctx, sb, key, dir)
		}
	}
}

// RouteCounts counts the open routes (sessions; released ones are not
// open) of the sandboxes this replica drives, by whether their runtime
// key's wrapper runs or is coming up (running) or not (stopped: suspended,
// stopped idle, or never launched). The allocation says it, not a
// discovery: a scrape reads memory only.
func (d *Driver) RouteCounts() (running, stopped int) {
	for _, sb := range d.owned() {
		sb.mu.Lock()
		for _, r := range sb.routes {
			if r.State == store.RouteReleased {
				continue
			}
			if s := sb.keyAllocations[r.RuntimeKey]; r.RuntimeKey != "" && s != nil && s.Alloc.Live() {
				running++
			} else {
				stopped++
			}
		}
		sb.mu.Unlock()
	}
	return running, stopped
}
