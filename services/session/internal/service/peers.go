package service

import (
	"context"
	"time"

	"agentplane.dev/pkg/gitrepo"

	"agentplane.dev/services/session/internal/session"
)

// Sandbox is what the session service needs of the sandbox service.
type Sandbox interface {
	// Prepare asks for the session's route and returns the route view at
	// once; restart continues a route that failed resume_state_lost with a
	// new conversation.
	Prepare(ctx context.Context, s *session.Session, restart bool) (session.RouteView, error)
	// Deliver writes msgs in order; sent is false when nothing was written.
	Deliver(ctx context.Context, s *session.Session, msgs []*session.Message) (sent bool, view session.RouteView, err error)
	// Abort sends a best-effort abort of the running turn.
	Abort(ctx context.Context, s *session.Session, messageID string) error
	// ReleaseRoute removes the session from its runtime key.
	ReleaseRoute(ctx context.Context, r RouteRef, reason string) (Release, error)
	// SuspendRoute stops the route's runtime (stop reason suspend) and says
	// whether its absence is verified; when not, ask again after retry.
	// session.ErrRuntimeShared when other sessions share the runtime.
	SuspendRoute(ctx context.Context, r RouteRef) (verified bool, retry time.Duration, err error)
	// ClaimSandbox binds the sandbox to the tenant unless it is bound, and
	// refuses one bound to another tenant (session.ErrSandboxTenantMismatch).
	ClaimSandbox(ctx context.Context, sandboxID string, t session.Tenant) error
	// CheckAgent resolves an agent profile (session.ErrAgentUnavailable
	// when the sandbox service has no such installed profile).
	CheckAgent(ctx context.Context, a session.Agent) (session.Agent, error)
	// CheckWorktree says whether a new session may join its directory
	// (session.ErrWorktreeRepoMismatch, session.ErrAgentMismatch).
	CheckWorktree(ctx context.Context, s *session.Session) error
	// WorktreeChanges returns the change set of the session's worktree.
	WorktreeChanges(ctx context.Context, s *session.Session) (*gitrepo.Changes, error)
	// PushWorktree commits and pushes the session's worktree.
	PushWorktree(ctx context.Context, s *session.Session, p Push) (Pushed, error)
	// ListWorktreeFiles returns a page of a directory of the session's
	// worktree, as the wrapper serving it sees it.
	ListWorktreeFiles(ctx context.Context, s *session.Session, l FileList) (FilePage, error)
	// ReadWorktreeFile returns a range of a file of the session's worktree.
	ReadWorktreeFile(ctx context.Context, s *session.Session, r FileRead) (FileData, error)
	// WriteWorktreeFiles writes files into the session's worktree, in
	// order, and returns the files and bytes written.
	WriteWorktreeFiles(ctx context.Context, s *session.Session, files []FileWrite) (int, int64, error)
	// UpdateEgress hands the session's current egress policy and version
	// to the sandbox service; once it returns, the sandbox's egress proxy
	// applies it to every new connection.
	UpdateEgress(ctx context.Context, s *session.Session) error
}

// RouteRef names a session's route and the tenant it belongs to.
type RouteRef struct {
	SessionID, SandboxID string
	Tenant               session.Tenant
}

// Push is a PushWorktree request: the branch, the commit message and the
// commit's author (empty: the agentplane identity).
type Push struct {
	Branch, Message         string
	AuthorName, AuthorEmail string
}

// Pushed is what PushWorktree pushed.
type Pushed struct {
	Commit, Ref string
	Committed   bool
}

// FileList asks for up to Limit entries of the worktree directory Path,
// sorted after the name After.
type FileList struct {
	Path, After string
	Limit       int
}

// FilePage is a page of a worktree directory.
type FilePage struct {
	Files []WorktreeFile
	More  bool // entries remain after the last one
}

// WorktreeFile is one entry of a worktree directory (a symlink is not
// followed).
type WorktreeFile struct {
	Name string
	Type FileType
	Size int64
	Mode uint32 // permission bits
}

// FileType is what a worktree entry is.
type FileType string

// File types.
const (
	FileRegular   FileType = "file"
	FileDirectory FileType = "directory"
	FileSymlink   FileType = "symlink"
	FileOther     FileType = "other"
)

// FileRead asks for up to Length bytes of the worktree file Path from
// Offset.
type FileRead struct {
	Path   string
	Offset int64
	Length int
}

// FileData is a range of a worktree file and the file's size.
type FileData struct {
	Data []byte
	Size int64
}

// FileWrite is one file of a WriteWorktreeFiles batch; Mode 0 keeps an
// existing file's permission bits.
type FileWrite struct {
	Path string
	Data []byte
	Mode uint32
}

// Release is the sandbox's answer to ReleaseRoute.
type Release struct {
	LastMember      bool
	AbsenceVerified bool
	// ExhaustedFinal: the runtime key's lease is exhausted and had its
	// final observation; DESIGN.md 3.5 lets the deletion complete.
	ExhaustedFinal bool
	RetryAfter     time.Duration
}

// Credentials is what the session service needs of the credential service.
// The secret passes through Put only and is never kept. Scope membership is
// not released here: the sandbox decides who leaves a scope and calls
// ReleaseMember with its owner fencing token inside ReleaseRoute (the
// credential service refuses a release without that token).
type Credentials interface {
	Put(ctx context.Context, sessionID string, class session.CredentialClass, secret string) (ref string, err error)
	// PutGit stores a git token bound to repoURL, whose pushes the git
	// route confines to branches under pushPrefix ("": the default).
	PutGit(ctx context.Context, sessionID, repoURL, username, pushPrefix, token string) (ref string, err error)
	DeleteBacking(ctx context.Context, ref string) error
}

// History is what the session service needs of the ingest service.
type History interface {
	// Delete tombstones a runtime session's history; a missing one is no error.
	Delete(ctx context.Context, runtimeSessionID string) error
	// Export reads one page (at most size items) of a runtime session's
	// history from token; ErrHistoryGone when ingest holds none.
	Export(ctx context.Context, runtimeSessionID, token string, size int) (HistoryPage, error)
}
