package driver

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// ReasonSuspend is the stop reason of a runtime key suspended on demand
// (SuspendRoute): the idle stop, asked for now. The session service shows
// routes lost for it as suspended.
const ReasonSuspend = "suspend"

// ErrRuntimeShared refuses to suspend a runtime key other sessions route
// to: stopping it would take their runtime away too.
var ErrRuntimeShared = errors.New("the runtime is shared with other sessions of the worktree")

// Suspend is the result of SuspendRoute.
type Suspend struct {
	AbsenceVerified bool
	RetryAfter      time.Duration
}

// SuspendRoute stops the runtime key of the session's route the way the
// idle stop does (tick.go stopping: the key's routes are lost with reason
// suspend, the wrapper lease is asked to stop) and reports whether the
// key's wrapper is verified absent, by the same check a release uses. The
// route, its workspace and the agent's home stay; the next Prepare
// relaunches the key once the stop is verified (checkStopped). Repeating
// the call only reports.
func (d *Driver) SuspendRoute(ctx context.Context, sandboxID, sessionID string) (Suspend, error) {
	// Like the other calls that talk to a route, it takes over only a
	// sandbox with stored routes and no live owner.
	sb, err := d.ownStored(ctx, sandboxID)
	if errors.Is(err, ErrRouteNotFound) {
		return Suspend{AbsenceVerified: true}, nil
	}
	if err != nil {
		return Suspend{}, err
	}
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil || r.State == store.RouteReleased || r.RuntimeKey == "" {
		// No runtime key: nothing of this session runs.
		sb.mu.Unlock()
		return Suspend{AbsenceVerified: true}, nil
	}
	key := r.RuntimeKey
	for id, o := range sb.routes {
		if id != sessionID && o.RuntimeKey == key && o.Member() {
			sb.mu.Unlock()
			return Suspend{}, ErrRuntimeShared
		}
	}
	var ch *keyChange
	if s := sb.keyAllocations[key]; s != nil {
		before := s.Alloc
		s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Stop{Now: d.cfg.Now(), Reason: ReasonSuspend})
		if s.Alloc.Phase != before.Phase {
			ch = &keyChange{key: key, instance: before.Instance, from: before, to: s.Alloc, conn: sb.conns[key]}
			d.persistAllocations(sb, []*store.KeyAllocation{s})
		}
	}
	sb.mu.Unlock()
	if ch != nil {
		d.stopping(ctx, sb, *ch)
	}
	ok, retry, err := d.cfg.Wrappers.AbsenceVerified(ctx, sb.id, key)
	if err != nil {
		// An inspection failure is never absence.
		d.log.Warn("suspend: absence not checked", "sandbox", sb.id, "runtime_key", key, "err", err)
		return Suspend{RetryAfter: time.Second}, nil
	}
	if !ok {
		return Suspend{RetryAfter: max(retry, 100*time.Millisecond)}, nil
	}
	// The tick would notice too; doing it now lets a resume relaunch at once.
	d.checkStopped(ctx, sb)
	return Suspend{AbsenceVerified: true}, nil
}
