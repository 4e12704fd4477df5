package driver

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/pkg/gitrepo"

	"agentplane.dev/services/sandbox/internal/control/store"
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
	filesTimeout   = time.Minute
)

// Pushed is the result of PushWorktree.
type Pushed struct {
	Commit, Ref string
	Committed   bool
}

// WorktreeChanges asks the route's wrapper for its worktree's change set.
func (d *Driver) WorktreeChanges(ctx context.Context, sandboxID, sessionID string) (gitrepo.Changes, error) {
	res, err := d.worktreeCall(ctx, sandboxID, sessionID, changesTimeout, WorktreeRequest{SessionID: sessionID})
	if err != nil || res.Changes == nil {
		return gitrepo.Changes{}, err
	}
	return *res.Changes, nil
}

// PushWorktree asks the route's wrapper to commit and push its worktree.
func (d *Driver) PushWorktree(ctx context.Context, sandboxID, sessionID string, push WorktreePush) (Pushed, error) {
	res, err := d.worktreeCall(ctx, sandboxID, sessionID, pushTimeout, WorktreeRequest{SessionID: sessionID, Push: &push})
	if err != nil {
		return Pushed{}, err
	}
	return Pushed{Commit: res.CommitID, Ref: res.Ref, Committed: res.Committed}, nil
}

// ListWorktreeFiles asks the route's wrapper for a page of a worktree
// directory: its entries and whether more remain.
func (d *Driver) ListWorktreeFiles(ctx context.Context, sandboxID, sessionID string, l WorktreeList) ([]WorktreeFile, bool, error) {
	res, err := d.worktreeCall(ctx, sandboxID, sessionID, filesTimeout, WorktreeRequest{SessionID: sessionID, List: &l})
	if err != nil {
		return nil, false, err
	}
	return res.Files, res.FilesMore, nil
}

// ReadWorktreeFile asks the route's wrapper for a range of a worktree file
// and the file's size.
func (d *Driver) ReadWorktreeFile(ctx context.Context, sandboxID, sessionID string, r WorktreeRead) ([]byte, int64, error) {
	res, err := d.worktreeCall(ctx, sandboxID, sessionID, filesTimeout, WorktreeRequest{SessionID: sessionID, Read: &r})
	if err != nil {
		return nil, 0, err
	}
	return res.Data, res.FileSize, nil
}

// WriteWorktreeFiles asks the route's wrapper to write files, in order; it
// returns the files and bytes written. A refused file stops the batch (its
// WorktreeError says which).
func (d *Driver) WriteWorktreeFiles(ctx context.Context, sandboxID, sessionID string, files []WorktreeWrite) (int, int64, error) {
	res, err := d.worktreeCall(ctx, sandboxID, sessionID, filesTimeout, WorktreeRequest{SessionID: sessionID, Write: files})
	return res.FilesWritten, res.BytesWritten, err
}

// worktreeCall sends req to the wrapper serving the route and waits, within
// bound, for its result. A wrapper that goes away meanwhile ends the wait.
func (d *Driver) worktreeCall(ctx context.Context, sandboxID, sessionID string, bound time.Duration, req WorktreeRequest) (WorktreeResult, error) {
	sb, err := d.ownStored(ctx, sandboxID)
	if err != nil {
		return WorktreeResult{}, err
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
		return WorktreeResult{}, ErrRouteNotFound
	}
	if c == nil || !ready {
		return WorktreeResult{}, ErrWorktreeUnavailable
	}
	req.RequestID = newID("wt_")
	done := make(chan WorktreeResult, 1)
	d.worktreeCalls.Store(req.RequestID, worktreeCall{conn: c, done: done})
	defer d.worktreeCalls.Delete(req.RequestID)
	if !c.send(req) {
		return WorktreeResult{}, ErrWorktreeUnavailable
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	select {
	case res := <-done:
		if res.ErrorReason != "" {
			return WorktreeResult{}, &WorktreeError{Reason: res.ErrorReason, Detail: res.ErrorDetail}
		}
		d.activity(sb, c.RuntimeKey)
		return res, nil
	case <-c.Closed:
		return WorktreeResult{}, ErrWorktreeUnavailable
	case <-ctx.Done():
		return WorktreeResult{}, ctx.Err()
	}
}

type worktreeCall struct {
	conn *Conn
	done chan WorktreeResult
}

// worktreeResult hands a wrapper's result to its waiting call; a result of
// another stream, or of a call that gave up, is dropped.
func (d *Driver) worktreeResult(c *Conn, res WorktreeResult) {
	v, ok := d.worktreeCalls.Load(res.RequestID)
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
