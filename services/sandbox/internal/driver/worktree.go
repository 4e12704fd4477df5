package driver

import (
	"context"
	"errors"
	"time"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/store"
)

// ReasonWorkspaceNoSpace is the route failure a wrapper reports when a
// clone filled the disk: ENOSPC evidence.
const ReasonWorkspaceNoSpace = "workspace_no_space"

// ErrWorktreeUnavailable: no connected wrapper serves the route now.
var ErrWorktreeUnavailable = errors.New("no wrapper serves the route's worktree now")

// WorktreeError is a worktree action the wrapper refused, with its
// UPPER_SNAKE reason (PUSH_REJECTED, REPO_AUTH_FAILED, ...).
type WorktreeError struct{ Reason, Detail string }

func (e *WorktreeError) Error() string { return "worktree: " + e.Reason + ": " + e.Detail }

// Bounds of a worktree action, from sending the request to its result.
const (
	changesTimeout = time.Minute
	pushTimeout    = 10 * time.Minute
)

// Pushed is the result of PushWorktree.
type Pushed struct {
	Commit, Ref string
	Committed   bool
}

// WorktreeChanges asks the route's wrapper for its worktree's change set.
func (d *Driver) WorktreeChanges(ctx context.Context, sandboxID, sessionID string) (*runtimev1.WorktreeChanges, error) {
	res, err := d.worktreeCall(ctx, sandboxID, sessionID, changesTimeout, &sandboxv1.WorktreeRequest{
		SessionId: sessionID, Action: &sandboxv1.WorktreeRequest_Changes{Changes: &sandboxv1.WorktreeChangesAction{}},
	})
	if err != nil {
		return nil, err
	}
	if res.GetChanges() == nil {
		return &runtimev1.WorktreeChanges{}, nil
	}
	return res.GetChanges(), nil
}

// PushWorktree asks the route's wrapper to commit and push its worktree.
func (d *Driver) PushWorktree(ctx context.Context, sandboxID, sessionID, branch, message string) (Pushed, error) {
	res, err := d.worktreeCall(ctx, sandboxID, sessionID, pushTimeout, &sandboxv1.WorktreeRequest{
		SessionId: sessionID, Action: &sandboxv1.WorktreeRequest_Push{Push: &sandboxv1.WorktreePushAction{Branch: branch, CommitMessage: message}},
	})
	if err != nil {
		return Pushed{}, err
	}
	return Pushed{Commit: res.GetCommitId(), Ref: res.GetRef(), Committed: res.GetCommitted()}, nil
}

// worktreeCall sends req to the wrapper serving the route and waits, within
// bound, for its result. A wrapper that goes away meanwhile ends the wait.
func (d *Driver) worktreeCall(ctx context.Context, sandboxID, sessionID string, bound time.Duration, req *sandboxv1.WorktreeRequest) (*sandboxv1.WorktreeResult, error) {
	sb, err := d.own(ctx, sandboxID)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	r := sb.routes[sessionID]
	var c *Conn
	if r != nil && r.State != store.RouteReleased {
		c = sb.conns[r.RuntimeKey]
	}
	ready := r != nil && r.State == store.RouteReady
	sb.mu.Unlock()
	if r == nil || r.State == store.RouteReleased {
		return nil, ErrRouteNotFound
	}
	if c == nil || !ready {
		return nil, ErrWorktreeUnavailable
	}
	req.RequestId = newID("wt_")
	done := make(chan *sandboxv1.WorktreeResult, 1)
	d.worktreeCalls.Store(req.RequestId, worktreeCall{conn: c, done: done})
	defer d.worktreeCalls.Delete(req.RequestId)
	if !c.send(&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_WorktreeRequest{WorktreeRequest: req}}) {
		return nil, ErrWorktreeUnavailable
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	select {
	case res := <-done:
		if res.GetErrorReason() != "" {
			return nil, &WorktreeError{Reason: res.GetErrorReason(), Detail: res.GetErrorDetail()}
		}
		d.activity(sb, c.RuntimeKey)
		return res, nil
	case <-c.Closed:
		return nil, ErrWorktreeUnavailable
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

type worktreeCall struct {
	conn *Conn
	done chan *sandboxv1.WorktreeResult
}

// worktreeResult hands a wrapper's result to its waiting call; a result of
// another stream, or of a call that gave up, is dropped.
func (d *Driver) worktreeResult(c *Conn, res *sandboxv1.WorktreeResult) {
	v, ok := d.worktreeCalls.Load(res.GetRequestId())
	if !ok {
		return
	}
	call := v.(worktreeCall)
	if call.conn != c {
		return
	}
	select {
	case call.done <- res:
	default:
	}
}
