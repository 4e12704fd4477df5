package driver

import (
	"context"
	"time"

	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// Credentials is the credential service as the driver uses it: the port its
// minting, adoption, rotation and release go through, so they can be tested
// without a server. internal/edge/credclient adapts the gRPC client to it. Every
// call carries the owner's fencing token; the service refuses an older one.
type Credentials interface {
	// Mint issues the route's handle. Under the worktree contract a scope
	// that already holds a handle accepted under this fence returns it
	// (adopted); a different allocation id retires the old entries first.
	Mint(ctx context.Context, m Mint) (handle string, adopted bool, err error)
	// ReleaseMember removes the session from its scope's members. A member
	// the service does not list (any more) is released: nil.
	ReleaseMember(ctx context.Context, s ScopeRef, sessionID string, fence uint64) error
	// RetireScope retires the scope's accepted handles after a wrapper
	// restart, so the next mint issues a fresh canonical handle.
	RetireScope(ctx context.Context, s ScopeRef, fence uint64) error
	// RotateHandle replaces the scope's canonical handle; the previous one
	// resolves until previousValidUntil.
	RotateHandle(ctx context.Context, s ScopeRef, fence uint64) (handle string, previousValidUntil time.Time, err error)
}

// ScopeRef names a credential scope: one directory of one sandbox.
type ScopeRef struct{ SandboxID, Directory string }

// Mint is what a handle is minted for: the route's member and credential,
// under the scope's contract, the owner's fence and the allocation.
type Mint struct {
	Scope                                      ScopeRef
	SessionID, RuntimeSessionID, UserID, OrgID string
	CredentialRef, CredentialClass             string // class "static" | "delegated"
	GitCredentialRef                           string
	Contract                                   scope.Contract
	FenceToken                                 uint64
	AllocationID                               string
}

// mintOf is the Mint of route r.
func mintOf(sandboxID, alloc string, token uint64, r store.Route) Mint {
	return Mint{
		Scope:     ScopeRef{SandboxID: sandboxID, Directory: r.Directory},
		SessionID: r.SessionID, RuntimeSessionID: r.RuntimeSessionID, UserID: r.UserID, OrgID: r.OrgID,
		CredentialRef: r.CredentialRef, CredentialClass: r.CredentialClass, GitCredentialRef: r.GitCredentialRef,
		Contract: r.Contract, FenceToken: token, AllocationID: alloc,
	}
}

// CredentialError is an answer of the credential service that is not a
// success, named by its status code: the driver logs the code only.
// internal/edge/credclient wraps the service's answers in it.
type CredentialError struct {
	Code string // the gRPC code's name: "Unavailable", "FailedPrecondition", ...
	Err  error
}

func (e *CredentialError) Error() string { return e.Err.Error() }
func (e *CredentialError) Unwrap() error { return e.Err }
