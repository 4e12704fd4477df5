package driver

import (
	"context"
	"errors"
	"slices"
	"time"

	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// ErrNotWorktree: rotation asked for a route whose runtime does not share
// a canonical worktree handle (per_session routes keep their own).
var ErrNotWorktree = errors.New("the route does not use the worktree contract")

// Rotated is the result of RotateHandle (never the handle itself).
type Rotated struct {
	Sessions           []string // routes whose wrapper got the new handle
	PreviousValidUntil time.Time
}

// RotateHandle rotates the canonical handle of the route's worktree scope
// and pushes it to the connected wrapper in a Credentials frame: the
// wrapper's provider relay adds the current handle to each request itself,
// so the agent's next model request carries it without a restart. The old
// handle resolves for the credential service's overlap window, which covers
// requests already under way.
func (d *Driver) RotateHandle(ctx context.Context, sandboxID, sessionID string) (Rotated, error) {
	sb, err := d.ownStored(ctx, sandboxID)
	if err != nil {
		return Rotated{}, err
	}
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil || r.State == store.RouteReleased {
		sb.mu.Unlock()
		return Rotated{}, ErrRouteNotFound
	}
	if r.Contract != scope.Worktree {
		sb.mu.Unlock()
		return Rotated{}, ErrNotWorktree
	}
	c := sb.conns[r.RuntimeKey]
	ready := r.State == store.RouteReady && sb.handles[sessionID] != ""
	key, dir, token := r.RuntimeKey, r.Directory, sb.owner.Token()
	sb.mu.Unlock()
	// A wrapper that is not connected could not take the new handle, and
	// would find its own stop working after the overlap window.
	if c == nil || !ready || d.cfg.Credentials == nil {
		return Rotated{}, ErrWorktreeUnavailable
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	h, previousValidUntil, err := d.cfg.Credentials.RotateHandle(cctx, ScopeRef{SandboxID: sandboxID, Directory: dir}, token)
	cancel()
	if err != nil {
		return Rotated{}, err
	}
	sb.mu.Lock()
	var ids []string
	for id, o := range sb.routes {
		if o.RuntimeKey == key && o.State != store.RouteReleased && sb.handles[id] != "" {
			sb.handles[id] = h
			ids = append(ids, id)
		}
	}
	sb.mu.Unlock()
	slices.Sort(ids)
	if !c.send(HandleUpdate{SessionIDs: ids, Handle: h}) {
		// The stream broke: the wrapper's next Hello resumes the routes and
		// gets the current handle again (resendHandle).
		return Rotated{}, ErrWorktreeUnavailable
	}
	return Rotated{Sessions: ids, PreviousValidUntil: previousValidUntil}, nil
}

// resendHandle gives a wrapper that reconnected (same instance, routes
// resumed) the handle its routes hold now: a Credentials frame of a
// rotation can be lost with the stream it was queued on.
func (d *Driver) resendHandle(sb *sandbox, c *Conn, resumed []string) {
	if c.Contract != scope.Worktree || len(resumed) == 0 {
		return
	}
	sb.mu.Lock()
	h := sb.handles[resumed[0]]
	sb.mu.Unlock()
	if h != "" {
		c.send(HandleUpdate{SessionIDs: resumed, Handle: h})
	}
}
