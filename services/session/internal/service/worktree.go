package service

import (
	"context"
	"time"

	"agentplane.dev/pkg/gitrepo"

	"agentplane.dev/services/session/internal/session"
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

// PushWorktree commits the worktree's changes and pushes branch.
func (s *Service) PushWorktree(ctx context.Context, id, branch, message string) (Pushed, error) {
	sess, err := s.liveSession(ctx, id)
	if err != nil {
		return Pushed{}, err
	}
	if sess.RepoURL == "" || sess.GitCredentialRef == "" {
		return Pushed{}, session.ErrNoRepository
	}
	ctx, cancel := context.WithTimeout(ctx, worktreeBound)
	defer cancel()
	return s.sandbox.PushWorktree(ctx, sess, branch, message)
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
