package session

import (
	"errors"
	"fmt"
	"time"
)

// Domain errors; the API layer maps each to one gRPC code and reason.
var (
	ErrSessionNotFound  = errors.New("session not found")
	ErrMessageNotFound  = errors.New("message not found")
	ErrMessageConflict  = errors.New("message id already used with other content")
	ErrSessionConflict  = errors.New("session id already used with another request")
	ErrPeerUnavailable  = errors.New("a peer service is unavailable")
	ErrConflictRetries  = errors.New("too many concurrent writers on the session")
	ErrInvalidPageToken = errors.New("malformed page token")
	// ErrAgentUnavailable: the sandbox service has no such (installed)
	// agent profile, or the model name is unusable.
	ErrAgentUnavailable = errors.New("agent unavailable")
	// ErrSandboxTenantMismatch: the session names a sandbox that belongs
	// to another tenant (or whether it exists is not said).
	ErrSandboxTenantMismatch = errors.New("the sandbox belongs to another tenant")
	// ErrWorktreeRepoMismatch: the directory is bound to another
	// repository (a live session of it was cloned from that one).
	ErrWorktreeRepoMismatch = errors.New("the directory is bound to another repository")
	// ErrAgentMismatch: the directory's shared runtime runs another agent
	// profile or model.
	ErrAgentMismatch = errors.New("the directory runs another agent")
	// ErrTurnRunning: SuspendSession without force while the session has
	// queued or accepted work.
	ErrTurnRunning = errors.New("a turn is running or queued; suspend with force to cancel it")
	// ErrRuntimeShared: the session's runtime serves other sessions of its
	// worktree too; suspending it would stop theirs.
	ErrRuntimeShared = errors.New("the session's runtime is shared with other sessions of its worktree")
)

// SuspendPendingError: the stop of a suspended session's runtime is asked
// for but the absence of its processes is not verified yet; the stop goes
// on and a repeated SuspendSession reports it.
type SuspendPendingError struct{ RetryAfter time.Duration }

func (e *SuspendPendingError) Error() string {
	return fmt.Sprintf("suspend pending: the runtime's absence is not verified yet; retry after %s", e.RetryAfter)
}

// RouteFailedError: a resumed route failed to prepare, for Reason.
type RouteFailedError struct{ Reason string }

func (e *RouteFailedError) Error() string { return "the route failed to prepare: " + e.Reason }

// Violation is one bad field of a request.
type Violation struct {
	Field       string
	Description string
}

// InvalidError is a request with bad fields; nothing was applied.
type InvalidError struct {
	Violations []Violation
}

func (e *InvalidError) Error() string {
	if len(e.Violations) == 0 {
		return "invalid request"
	}
	v := e.Violations[0]
	return fmt.Sprintf("invalid %s: %s", v.Field, v.Description)
}

// Invalid returns an *InvalidError for vs, or nil when vs is empty.
// ErrWriteWhileRunning: WriteWorktreeFiles without force while the session
// has queued or accepted work (the agent may be changing the same files).
// It is ErrTurnRunning to errors.Is, so it has that reason.
var ErrWriteWhileRunning error = writeWhileRunning{}

type writeWhileRunning struct{}

func (writeWhileRunning) Error() string {
	return "a turn is running or queued; write with force to write while it runs"
}
func (writeWhileRunning) Is(target error) bool { return target == ErrTurnRunning }

func Invalid(vs []Violation) error {
	if len(vs) == 0 {
		return nil
	}
	return &InvalidError{Violations: vs}
}

// CursorExpiredError is a watch cursor older than the trimmed part of the
// event log: resuming from it would silently skip the events trimmed since.
// Oldest is the oldest cursor still available (resuming after it starts
// at the first retained event).
type CursorExpiredError struct{ Oldest string }

func (e *CursorExpiredError) Error() string {
	return "cursor older than the retained event log; oldest cursor " + e.Oldest
}

// DeletionPendingError means a deletion intent is persisted but the absence
// of the session's processes is not verified yet; the reconciler keeps going.
type DeletionPendingError struct {
	RetryAfter time.Duration
	Step       string // what is pending, for operators (never secret)
}

func (e *DeletionPendingError) Error() string {
	return fmt.Sprintf("deletion pending cleanup (%s); retry after %s", e.Step, e.RetryAfter)
}
