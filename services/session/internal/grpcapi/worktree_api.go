package grpcapi

import (
	"context"
	"encoding/base64"

	"agentplane.dev/pkg/gitrepo"

	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/ident"
	"agentplane.dev/services/session/internal/service"
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
	p, err := a.svc.PushWorktree(ctx, r.GetSessionId(), service.Push{
		Branch: r.GetBranch(), Message: r.GetCommitMessage(), AuthorName: r.GetAuthorName(), AuthorEmail: r.GetAuthorEmail(),
	})
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.PushWorktreeResponse{CommitId: p.Commit, Ref: p.Ref, Committed: p.Committed}, nil
}

func (a *SessionAPI) ListWorktreeFiles(ctx context.Context, r *sessionv1.ListWorktreeFilesRequest) (*sessionv1.ListWorktreeFilesResponse, error) {
	l, err := validateListFiles(r)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	page, err := a.svc.ListWorktreeFiles(ctx, r.GetSessionId(), l)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	out := &sessionv1.ListWorktreeFilesResponse{Files: make([]*runtimev1.WorktreeFile, 0, len(page.Files))}
	for _, f := range page.Files {
		out.Files = append(out.Files, &runtimev1.WorktreeFile{Name: f.Name, Type: fileTypeProtos[f.Type], Size: f.Size, Mode: f.Mode})
	}
	if page.More && len(page.Files) > 0 {
		out.NextPageToken = base64.RawURLEncoding.EncodeToString([]byte(page.Files[len(page.Files)-1].Name))
	}
	return out, nil
}

func (a *SessionAPI) ReadWorktreeFile(ctx context.Context, r *sessionv1.ReadWorktreeFileRequest) (*sessionv1.ReadWorktreeFileResponse, error) {
	if err := validateReadFile(r); err != nil {
		return nil, a.fail(ctx, err)
	}
	n := int(r.GetLength())
	if n == 0 {
		n = ident.MaxWorktreeRead
	}
	d, err := a.svc.ReadWorktreeFile(ctx, r.GetSessionId(), service.FileRead{Path: r.GetPath(), Offset: r.GetOffset(), Length: n})
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.ReadWorktreeFileResponse{Data: d.Data, Size: d.Size}, nil
}

func (a *SessionAPI) WriteWorktreeFiles(ctx context.Context, r *sessionv1.WriteWorktreeFilesRequest) (*sessionv1.WriteWorktreeFilesResponse, error) {
	files, err := validateWriteFiles(r)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	n, bytes, err := a.svc.WriteWorktreeFiles(ctx, r.GetSessionId(), files, r.GetForce())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.WriteWorktreeFilesResponse{FilesWritten: int32(n), BytesWritten: bytes}, nil //nolint:gosec // at most 100
}

var fileTypeProtos = map[service.FileType]runtimev1.WorktreeFileType{
	service.FileRegular:   runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_FILE,
	service.FileDirectory: runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_DIRECTORY,
	service.FileSymlink:   runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_SYMLINK,
	service.FileOther:     runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_OTHER,
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
