// Package grpcapi serves SandboxService and WrapperControlService: it
// converts proto ↔ driver types and maps domain errors to statuses in one
// place (toStatus).
package grpcapi

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/storeerr"
	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/control/tenancy"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Reasons returned by the sandbox service (docs/errors.md).
const (
	ReasonInvalidRoute      = "INVALID_ROUTE"
	ReasonRouteNotFound     = "ROUTE_NOT_FOUND"
	ReasonScopeNotFound     = "SCOPE_NOT_FOUND"
	ReasonDirectoryConflict = "ROUTE_DIRECTORY_CONFLICT"
	ReasonRepoMismatch      = "WORKTREE_REPO_MISMATCH"
	ReasonAgentMismatch     = "AGENT_MISMATCH"
	ReasonClassMixed        = "CREDENTIAL_CLASS_MIXED"
	ReasonOwnedElsewhere    = "SANDBOX_OWNED_ELSEWHERE"
	ReasonCapacityRejected  = "CAPACITY_REJECTED"
	ReasonHelloRequired     = "HELLO_REQUIRED"
	ReasonUnavailable       = "SANDBOX_UNAVAILABLE"
	ReasonContractDowngrade = "RUNTIME_CONTRACT_DOWNGRADE"
	ReasonWorktreeUnavail   = "WORKTREE_UNAVAILABLE"
	ReasonNotWorktree       = "SCOPE_NOT_WORKTREE"
	ReasonInvalidEgress     = "INVALID_EGRESS_POLICY"
	ReasonTenantMismatch    = "SANDBOX_TENANT_MISMATCH"
	ReasonRuntimeShared     = "RUNTIME_SHARED"
)

// toStatus is the service's one error translator. A store outage is
// STORE_UNAVAILABLE; anything unrecognised is logged here and reaches the
// client as INTERNAL without its text (never as an outage it may not be).
func toStatus(ctx context.Context, log *slog.Logger, err error) error {
	var wt *driver.WorktreeError
	if log == nil {
		log = slog.Default()
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, tenancy.ErrMismatch):
		// Never says whether the sandbox exists: a sandbox id is no secret.
		return apierr.Error(codes.PermissionDenied, ReasonTenantMismatch, "the sandbox does not belong to this tenant")
	case errors.Is(err, driver.ErrRouteNotFound):
		return apierr.Error(codes.NotFound, ReasonRouteNotFound, "no route for this session in this sandbox")
	case errors.Is(err, driver.ErrWorktreeUnavailable):
		return apierr.Error(codes.FailedPrecondition, ReasonWorktreeUnavail, "no wrapper serves the session's worktree now; send a message to prepare the route",
			apierr.RetryAfter(5*time.Second))
	case errors.Is(err, driver.ErrRuntimeShared):
		return apierr.Error(codes.FailedPrecondition, ReasonRuntimeShared, "the session's runtime is shared with other sessions of its worktree; it is not suspended")
	case errors.Is(err, driver.ErrNotWorktree):
		return apierr.Error(codes.FailedPrecondition, ReasonNotWorktree, "the session's route holds a per-session handle, not a worktree handle to rotate")
	case errors.As(err, &wt):
		// The wrapper's reasons are the worktree reasons of docs/errors.md;
		// the detail is git's last line (no secret ever reaches git) or
		// names a path inside the worktree.
		return apierr.Error(worktreeCode(wt.Reason), wt.Reason, wt.Detail)
	case errors.Is(err, driver.ErrScopeNotFound):
		return apierr.Error(codes.NotFound, ReasonScopeNotFound, "no worktree scope for this directory")
	case errors.Is(err, driver.ErrDirectoryMoved):
		return apierr.Error(codes.FailedPrecondition, ReasonDirectoryConflict, "the session's route uses another directory",
			apierr.FieldViolation("route.directory", "differs from the session's existing route"))
	case errors.Is(err, driver.ErrWorktreeRepoMismatch):
		return apierr.Error(codes.FailedPrecondition, ReasonRepoMismatch, err.Error(),
			apierr.FieldViolation("repo_url", "differs from the repository the directory was cloned from"))
	case errors.Is(err, driver.ErrAgentMismatch):
		return apierr.Error(codes.FailedPrecondition, ReasonAgentMismatch, err.Error(),
			apierr.FieldViolation("agent", "differs from the agent the directory's runtime runs"))
	case errors.Is(err, driver.ErrClassMixed):
		return apierr.Error(codes.FailedPrecondition, ReasonClassMixed, "the directory already holds another credential class",
			apierr.FieldViolation("route.credential_class", "differs from the directory's class"))
	case errors.Is(err, driver.ErrOwnedElsewhere):
		// The owner's name and address let the caller send the call there
		// at once (grpcclient.OwnerRouter) instead of retrying at random.
		opts := []apierr.Option{apierr.RetryAfter(time.Second)}
		if oe := (*driver.OwnedElsewhereError)(nil); errors.As(err, &oe) {
			opts = append(opts, apierr.Metadata(apierr.MetaOwner, oe.Owner.Replica))
			if oe.Owner.Addr != "" {
				opts = append(opts, apierr.Metadata(apierr.MetaOwnerAddr, oe.Owner.Addr))
			}
		}
		return apierr.Error(codes.Unavailable, ReasonOwnedElsewhere, "another sandbox-service replica drives this sandbox", opts...)
	case errors.Is(err, driver.ErrStreamReplaced):
		return apierr.Error(codes.Unavailable, ReasonUnavailable, "a newer stream of this runtime key replaced this one")
	case errors.Is(err, driver.ErrStreamOverflow):
		return apierr.Error(codes.Unavailable, ReasonUnavailable, "the wrapper did not read its stream fast enough; reconnect",
			apierr.RetryAfter(time.Second))
	case errors.Is(err, driver.ErrShuttingDown):
		return apierr.Error(codes.Unavailable, ReasonUnavailable, "this sandbox-service replica is shutting down; reconnect",
			apierr.RetryAfter(time.Second))
	case errors.Is(err, agents.ErrUnavailable):
		return apierr.Error(codes.InvalidArgument, ReasonAgentUnavailable, err.Error(),
			apierr.FieldViolation("agent.profile", "not a configured and installed agent profile"))
	case errors.Is(err, agents.ErrBadModel):
		return apierr.Error(codes.InvalidArgument, ReasonAgentUnavailable, "the model name is not usable",
			apierr.FieldViolation("agent.model", "1-128 of [A-Za-z0-9._:/-]"))
	case errors.Is(err, provider.ErrCapacityRejected):
		return apierr.Error(codes.ResourceExhausted, ReasonCapacityRejected, "not enough free space for a cold workspace",
			apierr.RetryAfter(30*time.Second))
	case ctx.Err() == nil && errors.Is(err, storeerr.ErrNotReplicated):
		log.WarnContext(ctx, "write not confirmed on the state store's replicas", "error", err)
		return apierr.StoreNotReplicated()
	case ctx.Err() == nil && storeerr.Unavailable(err):
		log.WarnContext(ctx, "state store unavailable", "error", err)
		return apierr.StoreUnavailable()
	}
	return apierr.Unexpected(ctx, log, err)
}

func worktreeCode(reason string) codes.Code {
	switch reason {
	case "INVALID_BRANCH":
		return codes.InvalidArgument
	case "REPO_UNREACHABLE":
		return codes.Unavailable
	case "FILE_NOT_FOUND":
		return codes.NotFound
	}
	return codes.FailedPrecondition
}
