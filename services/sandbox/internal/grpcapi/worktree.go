package grpcapi

import (
	"context"

	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/wrapperconn"
)

// WorktreeChanges asks the route's wrapper for its change set.
func (s *Sandbox) WorktreeChanges(ctx context.Context, req *sandboxv1.WorktreeChangesRequest) (*sandboxv1.WorktreeChangesResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid worktree request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	ch, err := s.Driver.WorktreeChanges(ctx, req.GetSandboxId(), req.GetSessionId())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.WorktreeChangesResponse{Changes: wrapperconn.WorktreeChangesProto(ch)}, nil
}

// PushWorktree asks the route's wrapper to commit and push.
func (s *Sandbox) PushWorktree(ctx context.Context, req *sandboxv1.PushWorktreeRequest) (*sandboxv1.PushWorktreeResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(req.GetBranch() != "" && len(req.GetBranch()) <= 200, "branch", "1 to 200 bytes")
	v.check(req.GetCommitMessage() != "" && len(req.GetCommitMessage()) <= 64<<10, "commit_message", "1 byte to 64 KiB")
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid push request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	p, err := s.Driver.PushWorktree(ctx, req.GetSandboxId(), req.GetSessionId(), req.GetBranch(), req.GetCommitMessage())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.PushWorktreeResponse{CommitId: p.Commit, Ref: p.Ref, Committed: p.Committed}, nil
}

// RotateHandle rotates the route's worktree handle and pushes it to the
// wrapper serving it.
func (s *Sandbox) RotateHandle(ctx context.Context, req *sandboxv1.RotateHandleRequest) (*sandboxv1.RotateHandleResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid rotation request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	r, err := s.Driver.RotateHandle(ctx, req.GetSandboxId(), req.GetSessionId())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.RotateHandleResponse{SessionIds: r.Sessions, PreviousValidUntil: timestamppb.New(r.PreviousValidUntil)}, nil
}
