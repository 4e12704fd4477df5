package grpcapi

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/ident"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/edge/wrapperconn"
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
	v.why("author_name", ident.AuthorName(req.GetAuthorName()))
	v.why("author_email", ident.AuthorEmail(req.GetAuthorEmail()))
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid push request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	p, err := s.Driver.PushWorktree(ctx, req.GetSandboxId(), req.GetSessionId(), driver.WorktreePush{
		Branch: req.GetBranch(), CommitMessage: req.GetCommitMessage(), AuthorName: req.GetAuthorName(), AuthorEmail: req.GetAuthorEmail(),
	})
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.PushWorktreeResponse{CommitId: p.Commit, Ref: p.Ref, Committed: p.Committed}, nil
}

// ListWorktreeFiles asks the route's wrapper for a page of a directory.
func (s *Sandbox) ListWorktreeFiles(ctx context.Context, req *sandboxv1.ListWorktreeFilesRequest) (*sandboxv1.ListWorktreeFilesResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.why("path", ident.WorktreePath(req.GetPath()))
	v.check(req.GetLimit() > 0 && req.GetLimit() <= ident.MaxWorktreeEntries, "limit", "1 to 1000")
	v.check(len(req.GetAfter()) <= 255 && !strings.ContainsAny(req.GetAfter(), "/\x00"), "after", "an entry name")
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid worktree files request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	fs, more, err := s.Driver.ListWorktreeFiles(ctx, req.GetSandboxId(), req.GetSessionId(), driver.WorktreeList{
		Path: req.GetPath(), After: req.GetAfter(), Limit: int(req.GetLimit()),
	})
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.ListWorktreeFilesResponse{Files: wrapperconn.WorktreeFilesProto(fs), More: more}, nil
}

// ReadWorktreeFile asks the route's wrapper for a range of a file.
func (s *Sandbox) ReadWorktreeFile(ctx context.Context, req *sandboxv1.ReadWorktreeFileRequest) (*sandboxv1.ReadWorktreeFileResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(req.GetPath() != "", "path", "a file relative to the worktree")
	v.why("path", ident.WorktreePath(req.GetPath()))
	v.check(req.GetOffset() >= 0, "offset", "at least 0")
	v.check(req.GetLength() > 0 && req.GetLength() <= ident.MaxWorktreeRead, "length", "1 byte to 1 MiB")
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid worktree file request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	data, size, err := s.Driver.ReadWorktreeFile(ctx, req.GetSandboxId(), req.GetSessionId(), driver.WorktreeRead{
		Path: req.GetPath(), Offset: req.GetOffset(), Length: int(req.GetLength()),
	})
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.ReadWorktreeFileResponse{Data: data, Size: size}, nil
}

// WriteWorktreeFiles asks the route's wrapper to write a batch of files.
func (s *Sandbox) WriteWorktreeFiles(ctx context.Context, req *sandboxv1.WriteWorktreeFilesRequest) (*sandboxv1.WriteWorktreeFilesResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(len(req.GetFiles()) > 0 && len(req.GetFiles()) <= ident.MaxWorktreeWriteFiles, "files", "1 to 100 files")
	files := make([]driver.WorktreeWrite, 0, len(req.GetFiles()))
	total := 0
	for i, f := range req.GetFiles() {
		field := fmt.Sprintf("files[%d]", i)
		v.check(f.GetPath() != "", field+".path", "a file relative to the worktree")
		v.why(field+".path", ident.WorktreePath(f.GetPath()))
		v.check(f.GetMode() <= 0o777, field+".mode", "permission bits, at most 0o777")
		total += len(f.GetData())
		files = append(files, driver.WorktreeWrite{Path: f.GetPath(), Data: f.GetData(), Mode: f.GetMode()})
	}
	v.check(total <= ident.MaxWorktreeWriteBytes, "files", "at most 3 MiB of data in all")
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid worktree write request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	n, bytes, err := s.Driver.WriteWorktreeFiles(ctx, req.GetSandboxId(), req.GetSessionId(), files)
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.WriteWorktreeFilesResponse{FilesWritten: int32(n), BytesWritten: bytes}, nil //nolint:gosec // at most 100
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
