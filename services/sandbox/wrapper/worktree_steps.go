package wrapper

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/agent/ingestpost"
	"agentplane.dev/services/sandbox/wrapper/workfiles"
	"agentplane.dev/services/sandbox/wrapper/worktree"
)

// gitRoute is what a route knows of its repository (docs/worktrees.md).
type gitRoute struct {
	repoURL, ref     string
	clone            bool // clone repoURL at preparation (the session has a git credential)
	depth            int
	proxyURL, handle string
}

// Bounds of the worktree steps.
const (
	cloneTimeout   = 30 * time.Minute
	reportTimeout  = time.Minute
	pushTimeout    = 10 * time.Minute
	maxDiffBytes   = 256 << 10 // of a change set's unified diff
	diffPostBudget = 30 * time.Second
)

// prepareWorktree clones the route's repository into a workspace that is
// not prepared yet, or reuses it warm; it reports whether the route may go
// on. A failure fails the route with its named reason.
func (w *wrapper) prepareWorktree(id, dir string) bool {
	w.mu.Lock()
	g := w.routes[id].git
	w.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), cloneTimeout)
	defer cancel()
	clone := ""
	if g.clone {
		clone = g.repoURL
	}
	warm, err := worktree.Prepare(ctx, worktree.Spec{
		Dir: dir, RepoURL: clone, Ref: g.ref, Depth: g.depth, ProxyURL: g.proxyURL,
		Handle: func() string { return w.handleOf(id) }, MaxBytes: w.opts.MaxRepoBytes,
	}, func(step, detail string) { w.emit(progress(id, step, detail)) })
	if err != nil {
		f := worktree.AsFailure(err, "worktree_setup_failed")
		w.log.Warn("worktree preparation failed", "session", id, "reason", f.Reason, "detail", f.Detail)
		w.mu.Lock()
		delete(w.routes, id)
		w.mu.Unlock()
		w.emit(routeFailed(id, f.Reason, f.Detail, f.Retryable))
		return false
	}
	if warm && clone != "" {
		w.emit(progress(id, "prepare_worktree", "reusing the prepared workspace"))
	}
	return true
}

func (w *wrapper) handleOf(id string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if r := w.routes[id]; r != nil {
		return r.git.handle
	}
	return ""
}

// setHandle applies a delivered or rotated handle to the routes' git access.
func (w *wrapper) setHandle(ids []string, h string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, id := range ids {
		if r := w.routes[id]; r != nil {
			r.git.handle = h
		}
	}
}

// worktreeRequest answers a WorktreeRequest of the sandbox service.
func (w *wrapper) worktreeRequest(req *sandboxv1.WorktreeRequest) {
	res := &sandboxv1.WorktreeResult{RequestId: req.GetRequestId()}
	defer func() {
		w.emit(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_WorktreeResult{WorktreeResult: res}})
	}()
	id := req.GetSessionId()
	w.mu.Lock()
	r := w.routes[id]
	var dir string
	var g gitRoute
	if r != nil {
		dir, g = r.directory, r.git
	}
	w.mu.Unlock()
	if r == nil || dir == "" {
		res.ErrorReason, res.ErrorDetail = worktree.WorktreeUnavailable, "the wrapper serves no route for the session"
		return
	}
	switch a := req.GetAction().(type) {
	case *sandboxv1.WorktreeRequest_Changes:
		ctx, cancel := context.WithTimeout(context.Background(), reportTimeout)
		defer cancel()
		ch, err := worktree.Report(ctx, dir, maxDiffBytes)
		if errors.Is(err, worktree.ErrNotARepository) {
			res.ErrorReason, res.ErrorDetail = worktree.WorktreeUnavailable, "the workspace is not a git checkout"
			return
		}
		if err != nil {
			res.ErrorReason, res.ErrorDetail = worktree.WorktreeUnavailable, "git could not report the change set"
			return
		}
		res.Changes = ChangesToProto(ch)
	case *sandboxv1.WorktreeRequest_Push:
		ctx, cancel := context.WithTimeout(context.Background(), pushTimeout)
		defer cancel()
		out, err := worktree.Push(ctx, worktree.PushSpec{
			Dir: dir, RepoURL: g.repoURL, ProxyURL: g.proxyURL, Handle: func() string { return w.handleOf(id) },
			Branch: a.Push.GetBranch(), Message: a.Push.GetCommitMessage(),
			AuthorName: a.Push.GetAuthorName(), AuthorEmail: a.Push.GetAuthorEmail(),
		})
		if err != nil {
			f := worktree.AsFailure(err, worktree.PushRejected)
			res.ErrorReason, res.ErrorDetail = f.Reason, f.Detail
			return
		}
		res.CommitId, res.Ref, res.Committed = out.Commit, out.Ref, out.Committed
	case *sandboxv1.WorktreeRequest_List:
		es, more, err := workfiles.List(dir, a.List.GetPath(), a.List.GetAfter(), int(a.List.GetLimit()))
		if err != nil {
			res.ErrorReason, res.ErrorDetail = fileFailure(err)
			return
		}
		res.Files, res.FilesMore = filesToProto(es), more
	case *sandboxv1.WorktreeRequest_Read:
		data, size, err := workfiles.Read(dir, a.Read.GetPath(), a.Read.GetOffset(), int(a.Read.GetLength()))
		if err != nil {
			res.ErrorReason, res.ErrorDetail = fileFailure(err)
			return
		}
		res.Data, res.FileSize = data, size
	case *sandboxv1.WorktreeRequest_Write:
		for i, f := range a.Write.GetFiles() {
			if err := workfiles.Write(dir, f.GetPath(), f.GetData(), f.GetMode()); err != nil {
				reason, detail := fileFailure(err)
				res.ErrorReason, res.ErrorDetail = reason, fmt.Sprintf("files[%d]: %s (the %d before it were written)", i, detail, i)
				return
			}
			res.FilesWritten++
			res.BytesWritten += int64(len(f.GetData()))
		}
	default:
		res.ErrorReason, res.ErrorDetail = worktree.WorktreeUnavailable, "unknown worktree action"
	}
}

// ChangesToProto converts a change set.
func ChangesToProto(c *worktree.Changes) *runtimev1.WorktreeChanges {
	out := &runtimev1.WorktreeChanges{Diff: c.Diff, DiffTruncated: c.Truncated, HeadCommit: c.Head, Time: timestamppb.New(c.Time)}
	for _, f := range c.Files {
		k := runtimev1.FileChangeKind_FILE_CHANGE_KIND_MODIFIED
		switch f.Kind {
		case worktree.Added:
			k = runtimev1.FileChangeKind_FILE_CHANGE_KIND_ADDED
		case worktree.Deleted:
			k = runtimev1.FileChangeKind_FILE_CHANGE_KIND_DELETED
		}
		out.Files = append(out.Files, &runtimev1.FileChange{Path: f.Path, Kind: k})
	}
	return out
}

func fileFailure(err error) (reason, detail string) {
	var e *workfiles.Error
	if errors.As(err, &e) {
		return e.Reason, e.Detail
	}
	return workfiles.Unavailable, "the file action failed"
}

var fileTypes = map[workfiles.Type]runtimev1.WorktreeFileType{
	workfiles.File:      runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_FILE,
	workfiles.Directory: runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_DIRECTORY,
	workfiles.Symlink:   runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_SYMLINK,
	workfiles.Other:     runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_OTHER,
}

func filesToProto(es []workfiles.Entry) []*runtimev1.WorktreeFile {
	out := make([]*runtimev1.WorktreeFile, 0, len(es))
	for _, e := range es {
		out = append(out, &runtimev1.WorktreeFile{Name: e.Name, Type: fileTypes[e.Type], Size: e.Size, Mode: e.Mode})
	}
	return out
}

// recordChanges posts the worktree's change set after a turn as a `diff`
// item to the route's history, through the proxy's ingest route (the
// runtime posts the rest of the turn there). Best effort: a failure is
// logged, the turn is already settled.
func (w *wrapper) recordChanges(id, turnID string) {
	w.mu.Lock()
	r := w.routes[id]
	var dir, rsid string
	var g gitRoute
	if r != nil {
		dir, rsid, g = r.directory, r.runtimeSessionID, r.git
	}
	w.mu.Unlock()
	if r == nil || rsid == "" || g.proxyURL == "" || g.handle == "" || !worktree.IsRepository(dir) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), diffPostBudget)
	defer cancel()
	ch, err := worktree.Report(ctx, dir, maxDiffBytes)
	if err != nil {
		w.log.Warn("change set not recorded", "session", id, "err", err)
		return
	}
	if turnID == "" {
		turnID = ch.Time.Format("20060102T150405.000000000")
	}
	body, _ := json.Marshal(map[string]any{"items": []map[string]any{{
		"item_id": "diff-" + turnID, "type": "diff", "version": 1, "time": ch.Time, "payload": ch,
	}}})
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	if err := ingestpost.Post(ctx, client, g.proxyURL, g.handle, rsid, body); err != nil {
		w.log.Warn("change set not recorded", "session", id, "err", err)
	}
}
