// Package grpcapi serves the session service's gRPC contracts: it validates
// requests, converts between protobuf and the domain, and maps domain errors
// to statuses in one place (toStatus).
package grpcapi

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/storeerr"
	"agentplane.dev/services/session/internal/session"
)

// Reasons (ErrorInfo.Reason) of the session service; docs/errors.md lists them.
const (
	ReasonInvalidRequest         = "INVALID_REQUEST"
	ReasonSessionNotFound        = "SESSION_NOT_FOUND"
	ReasonMessageNotFound        = "MESSAGE_NOT_FOUND"
	ReasonMessageIDConflict      = "MESSAGE_ID_CONFLICT"
	ReasonSessionIDConflict      = "SESSION_ID_CONFLICT"
	ReasonDeletionPendingCleanup = "DELETION_PENDING_CLEANUP"
	ReasonPeerUnavailable        = "PEER_UNAVAILABLE"
	ReasonAgentUnavailable       = "AGENT_UNAVAILABLE"
	ReasonSandboxTenantMismatch  = "SANDBOX_TENANT_MISMATCH"
	ReasonWorktreeRepoMismatch   = "WORKTREE_REPO_MISMATCH"
	ReasonAgentMismatch          = "AGENT_MISMATCH"
	ReasonSessionBusy            = "SESSION_BUSY"
	ReasonCursorExpired          = "CURSOR_EXPIRED"
	ReasonInternal               = "INTERNAL"
	ReasonNoRepository           = "NO_REPOSITORY"
	ReasonEgressVersionConflict  = "EGRESS_VERSION_CONFLICT"
	ReasonDirectoryReserved      = "DIRECTORY_RESERVED"
	ReasonTurnRunning            = "TURN_RUNNING"
	ReasonRuntimeShared          = "RUNTIME_SHARED"
	ReasonSuspendPending         = "SUSPEND_PENDING"
	ReasonRouteFailed            = "ROUTE_FAILED"
)

// toStatus is the service's one error translator. Internal errors are
// logged here and reach clients without their text.
func toStatus(ctx context.Context, log *slog.Logger, err error) error {
	var invalid *session.InvalidError
	var pending *session.DeletionPendingError
	var expired *session.CursorExpiredError
	var wt *session.WorktreeError
	var suspending *session.SuspendPendingError
	var routeFailed *session.RouteFailedError
	switch {
	case errors.As(err, &wt):
		return worktreeStatus(wt)
	case errors.Is(err, session.ErrNoRepository):
		return apierr.Error(codes.FailedPrecondition, ReasonNoRepository, "the session names no repository with a git credential to push to",
			apierr.FieldViolation("session_id", "the session has no worktree.repo_url and git_credential"))
	case err == nil:
		return nil
	}
	if st := sentinelStatus(err); st != nil {
		return st
	}
	switch {
	case errors.As(err, &invalid):
		return invalidStatus(invalid)
	case errors.As(err, &pending):
		return apierr.Error(codes.FailedPrecondition, ReasonDeletionPendingCleanup,
			"deletion is persisted; cleanup is not verified yet and continues in the background",
			apierr.RetryAfter(pending.RetryAfter), apierr.Metadata("pending_step", pending.Step))
	case errors.As(err, &suspending):
		return apierr.Error(codes.Unavailable, ReasonSuspendPending,
			"the runtime's stop is asked for; the absence of its processes is not verified yet and the stop continues",
			apierr.RetryAfter(suspending.RetryAfter))
	case errors.As(err, &routeFailed):
		return apierr.Error(codes.FailedPrecondition, ReasonRouteFailed, "the route failed to prepare",
			apierr.Metadata("failure_reason", routeFailed.Reason))
	case errors.As(err, &expired):
		return apierr.Error(codes.OutOfRange, ReasonCursorExpired,
			"the cursor is older than the retained event log; events after it were trimmed",
			apierr.FieldViolation("cursor", "older than the retained event log"), apierr.Metadata("oldest_cursor", expired.Oldest))
	case errors.Is(err, session.ErrPeerUnavailable):
		log.WarnContext(ctx, "peer unavailable", "error", err)
		return apierr.Error(codes.Unavailable, ReasonPeerUnavailable, "a dependency is unavailable; retry")
	case errors.Is(err, session.ErrConflictRetries):
		return apierr.Error(codes.Aborted, ReasonSessionBusy, "too many concurrent changes of the session; retry")
	case ctx.Err() == nil && errors.Is(err, storeerr.ErrNotReplicated):
		log.WarnContext(ctx, "write not confirmed on the state store's replicas", "error", err)
		return apierr.StoreNotReplicated()
	case ctx.Err() == nil && storeerr.Unavailable(err):
		log.WarnContext(ctx, "state store unavailable", "error", err)
		return apierr.StoreUnavailable()
	}
	return apierr.Unexpected(ctx, log, err)
}

// sentinelStatus translates the session package's sentinel errors of bad
// or conflicting requests; nil for any other error (toStatus goes on).
func sentinelStatus(err error) error {
	switch {
	case errors.Is(err, session.ErrInvalidPageToken):
		return apierr.Error(codes.InvalidArgument, ReasonInvalidRequest, "malformed page token",
			apierr.FieldViolation("page_token", "not a token from a previous response"))
	case errors.Is(err, session.ErrSessionNotFound):
		return apierr.Error(codes.NotFound, ReasonSessionNotFound, "session not found",
			apierr.FieldViolation("session_id", "no such session"))
	case errors.Is(err, session.ErrMessageNotFound):
		return apierr.Error(codes.NotFound, ReasonMessageNotFound, "message not found",
			apierr.FieldViolation("message_id", "no such message in the session"))
	case errors.Is(err, session.ErrMessageConflict):
		return apierr.Error(codes.AlreadyExists, ReasonMessageIDConflict,
			"message_id was already used with other content",
			apierr.FieldViolation("message_id", "already used with other content"))
	case errors.Is(err, session.ErrSessionConflict):
		return apierr.Error(codes.AlreadyExists, ReasonSessionIDConflict,
			"session_id was already used with another request",
			apierr.FieldViolation("session_id", "already used with another request"))
	case errors.Is(err, session.ErrTurnRunning):
		return apierr.Error(codes.FailedPrecondition, ReasonTurnRunning, err.Error(),
			apierr.FieldViolation("force", "the session has queued or accepted work; set force to go ahead"))
	case errors.Is(err, session.ErrRuntimeShared):
		return apierr.Error(codes.FailedPrecondition, ReasonRuntimeShared, err.Error())
	case errors.Is(err, session.ErrEgressVersionConflict):
		return apierr.Error(codes.Aborted, ReasonEgressVersionConflict, "the egress policy changed since expected_version; read the session and try again",
			apierr.FieldViolation("expected_version", "not the current egress_version"))
	case errors.Is(err, session.ErrWorktreeRepoMismatch):
		return apierr.Error(codes.FailedPrecondition, ReasonWorktreeRepoMismatch, err.Error(),
			apierr.FieldViolation("worktree.repo_url", "differs from the repository the directory was cloned from"))
	case errors.Is(err, session.ErrAgentMismatch):
		return apierr.Error(codes.FailedPrecondition, ReasonAgentMismatch, err.Error(),
			apierr.FieldViolation("agent", "differs from the agent the directory's runtime runs"))
	case errors.Is(err, session.ErrAgentUnavailable):
		return apierr.Error(codes.InvalidArgument, ReasonAgentUnavailable, err.Error(),
			apierr.FieldViolation("agent.profile", "not an agent profile the sandbox service has installed"))
	case errors.Is(err, session.ErrSandboxTenantMismatch):
		// Never says whether the sandbox exists: a sandbox id is no secret.
		return apierr.Error(codes.PermissionDenied, ReasonSandboxTenantMismatch, "the sandbox does not belong to this tenant",
			apierr.FieldViolation("sandbox_id", "a sandbox of another tenant"))
	}
	return nil
}

// worktreeStatus translates a failed git step or file action of the
// wrapper (its reason is the ErrorInfo reason; docs/errors.md, Session).
func worktreeStatus(wt *session.WorktreeError) error {
	code := codes.FailedPrecondition
	opts := []apierr.Option{}
	switch wt.Reason {
	case "INVALID_BRANCH":
		code = codes.InvalidArgument
		opts = append(opts, apierr.FieldViolation("branch", "not a valid git branch name"))
	case "REPO_UNREACHABLE":
		code = codes.Unavailable
		opts = append(opts, apierr.RetryAfter(5*time.Second))
	case "WORKTREE_UNAVAILABLE":
		opts = append(opts, apierr.RetryAfter(5*time.Second))
	case "FILE_NOT_FOUND":
		code = codes.NotFound
	}
	return apierr.Error(code, wt.Reason, wt.Detail, opts...)
}

// invalidStatus translates a refused request, one field violation per
// invalid field.
func invalidStatus(invalid *session.InvalidError) error {
	opts := make([]apierr.Option, 0, len(invalid.Violations))
	for _, v := range invalid.Violations {
		opts = append(opts, apierr.FieldViolation(v.Field, v.Description))
	}
	return apierr.Error(codes.InvalidArgument, ReasonInvalidRequest, invalid.Error(), opts...)
}
