package grpcapi

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/storeerr"
	"agentplane.dev/services/ingest/internal/history"
	"agentplane.dev/services/ingest/internal/scope"
	"agentplane.dev/services/ingest/internal/store"
)

// Reasons (ErrorInfo.Reason) of the ingest service; listed in docs/errors.md.
const (
	ReasonInvalidRequest         = "INVALID_REQUEST"
	ReasonLimitExceeded          = "LIMIT_EXCEEDED"
	ReasonRuntimeSessionNotFound = "RUNTIME_SESSION_NOT_FOUND"
	ReasonRuntimeSessionDeleted  = "RUNTIME_SESSION_DELETED"
	ReasonRuntimeSessionConflict = "RUNTIME_SESSION_CONFLICT"
	ReasonScopeMismatch          = "SCOPE_MISMATCH"
	ReasonScopeCheckUnavailable  = "SCOPE_CHECK_UNAVAILABLE"
	ReasonInternal               = "INTERNAL"
	scopeCheckRetryDelay         = time.Second
)

// toStatus is the service's one translation from domain errors to gRPC statuses. Internal
// errors are logged here and reach the client without their text.
func (s *Service) toStatus(ctx context.Context, err error) error {
	var invalid *history.InvalidError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &invalid):
		opts := make([]apierr.Option, 0, len(invalid.Violations))
		for _, v := range invalid.Violations {
			opts = append(opts, apierr.FieldViolation(v.Field, v.Description))
		}
		reason := ReasonInvalidRequest
		if invalid.HasLimit() {
			reason = ReasonLimitExceeded
		}
		return apierr.Error(codes.InvalidArgument, reason, invalid.Error(), opts...)
	case errors.Is(err, store.ErrBadCursor):
		return apierr.Error(codes.InvalidArgument, ReasonInvalidRequest, "malformed cursor",
			apierr.FieldViolation("cursor", "must be empty or a cursor returned by this service"))
	case errors.Is(err, history.ErrNotFound):
		return apierr.Error(codes.NotFound, ReasonRuntimeSessionNotFound, "runtime session not found")
	case errors.Is(err, history.ErrDeleted):
		return apierr.Error(codes.NotFound, ReasonRuntimeSessionDeleted, "runtime session deleted")
	case errors.Is(err, history.ErrConflict):
		return apierr.Error(codes.AlreadyExists, ReasonRuntimeSessionConflict, "runtime session exists with other metadata")
	case errors.Is(err, scope.ErrMismatch):
		return apierr.Error(codes.PermissionDenied, ReasonScopeMismatch, "scope does not admit this runtime session")
	case errors.Is(err, scope.ErrUnavailable):
		s.log.WarnContext(ctx, "scope membership check failed", "error", err)
		return apierr.Error(codes.Unavailable, ReasonScopeCheckUnavailable, "scope membership check unavailable", apierr.RetryAfter(scopeCheckRetryDelay))
	case ctx.Err() == nil && errors.Is(err, storeerr.ErrNotReplicated):
		s.log.WarnContext(ctx, "write not confirmed on the state store's replicas", "error", err)
		return apierr.StoreNotReplicated()
	case ctx.Err() == nil && storeerr.Unavailable(err):
		s.log.WarnContext(ctx, "state store unavailable", "error", err)
		return apierr.StoreUnavailable()
	default:
		return apierr.Unexpected(ctx, s.log, err)
	}
}
