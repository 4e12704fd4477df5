package service

import (
	"context"
	"time"

	"agentplane.dev/pkg/gitrepo"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// worktreeBound bounds a push end to end (the sandbox bounds its own wait).
const worktreeBound = 11 * time.Minute

// WorktreeChanges returns the current change set of the session's worktree.
func (s *Service) WorktreeChanges(ctx context.Context, id string) (*gitrepo.Changes, error) {
	sess, err := s.liveSession(ctx, id)
	if err != nil {
		return nil, err
	}
	return s.sandbox.WorktreeChanges(ctx, sess)
}

// PushWorktree commits the worktree's changes and pushes p.Branch.
func (s *Service) PushWorktree(ctx context.Context, id string, p Push) (Pushed, error) {
	sess, err := s.liveSession(ctx, id)
	if err != nil {
		return Pushed{}, err
	}
	if sess.RepoURL == "" || sess.GitCredentialRef == "" {
		return Pushed{}, session.ErrNoRepository
	}
	ctx, cancel := context.WithTimeout(ctx, worktreeBound)
	defer cancel()
	return s.sandbox.PushWorktree(ctx, sess, p)
}

// ListWorktreeFiles returns a page of a directory of the session's
// worktree; the wrapper serving it reads it, confined to the worktree.
func (s *Service) ListWorktreeFiles(ctx context.Context, id string, l FileList) (FilePage, error) {
	sess, err := s.liveSession(ctx, id)
	if err != nil {
		return FilePage{}, err
	}
	return s.sandbox.ListWorktreeFiles(ctx, sess, l)
}

// ReadWorktreeFile returns a range of a file of the session's worktree.
func (s *Service) ReadWorktreeFile(ctx context.Context, id string, r FileRead) (FileData, error) {
	sess, err := s.liveSession(ctx, id)
	if err != nil {
		return FileData{}, err
	}
	return s.sandbox.ReadWorktreeFile(ctx, sess, r)
}

// WriteWorktreeFiles writes files into the session's worktree, refusing
// (session.ErrWriteWhileRunning) while it has queued or accepted work
// unless force. The check is at the call: a message sent meanwhile runs
// alongside the write.
func (s *Service) WriteWorktreeFiles(ctx context.Context, id string, files []FileWrite, force bool) (int, int64, error) {
	a, err := s.store.Read(ctx, id, store.Load{})
	if err != nil {
		return 0, 0, err
	}
	if a.Session.State == session.StateDeleting || a.Intent != nil {
		return 0, 0, session.ErrSessionNotFound
	}
	if a.Busy() && !force {
		return 0, 0, session.ErrWriteWhileRunning
	}
	return s.sandbox.WriteWorktreeFiles(ctx, &a.Session, files)
}

func (s *Service) liveSession(ctx context.Context, id string) (*session.Session, error) {
	sess, err := s.store.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if sess.State == session.StateDeleting {
		return nil, session.ErrSessionNotFound
	}
	return sess, nil
}
