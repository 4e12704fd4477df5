package grpcapi

import (
	"context"

	"agentplane.dev/pkg/gitrepo"

	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

func (a *SessionAPI) GetWorktreeChanges(ctx context.Context, r *sessionv1.GetWorktreeChangesRequest) (*sessionv1.GetWorktreeChangesResponse, error) {
	if err := validateSessionID(r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	c, err := a.svc.WorktreeChanges(ctx, r.GetSessionId())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.GetWorktreeChangesResponse{Changes: changesToProto(c)}, nil
}

func (a *SessionAPI) PushWorktree(ctx context.Context, r *sessionv1.PushWorktreeRequest) (*sessionv1.PushWorktreeResponse, error) {
	if err := validatePush(r); err != nil {
		return nil, a.fail(ctx, err)
	}
	p, err := a.svc.PushWorktree(ctx, r.GetSessionId(), r.GetBranch(), r.GetCommitMessage())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.PushWorktreeResponse{CommitId: p.Commit, Ref: p.Ref, Committed: p.Committed}, nil
}

func changesToProto(c *gitrepo.Changes) *runtimev1.WorktreeChanges {
	out := &runtimev1.WorktreeChanges{Diff: c.Diff, DiffTruncated: c.DiffTruncated, HeadCommit: c.HeadCommit}
	if !c.Time.IsZero() {
		out.Time = timestamppb.New(c.Time)
	}
	for _, f := range c.Files {
		k := runtimev1.FileChangeKind_FILE_CHANGE_KIND_MODIFIED
		switch f.Kind {
		case gitrepo.FileAdded:
			k = runtimev1.FileChangeKind_FILE_CHANGE_KIND_ADDED
		case gitrepo.FileDeleted:
			k = runtimev1.FileChangeKind_FILE_CHANGE_KIND_DELETED
		}
		out.Files = append(out.Files, &runtimev1.FileChange{Path: f.Path, Kind: k})
	}
	return out
}
