// Package scope decides whether a caller's scope metadata admits a target runtime session.
//
//   - No metadata: an internal-token call (the session service deleting history, an operator);
//     admitted. Internal auth already ran in the server's interceptors.
//   - V1 (per-session handle): only the caller's own runtime session.
//   - V2 (adopted worktree handle): any live member root of the worktree scope, provided the
//     member the handle resolved through is live too, each of the resolving member's tenant.
//     A deleted member's root, another scope's and another tenant's are refused.
package scope

import (
	"context"
	"errors"
	"fmt"
)

// ErrMismatch: the metadata does not admit the target runtime session.
var ErrMismatch = errors.New("scope does not admit this runtime session")

// ErrUnavailable wraps a failed membership check; the caller may retry.
var ErrUnavailable = errors.New("scope membership check unavailable")

// Metadata is the scope a request carries; at most one of V1 and V2 is set.
type Metadata struct {
	V1 *V1
	V2 *V2
}

// V1 names the caller's own runtime session.
type V1 struct {
	RuntimeSessionID string
}

// V2 names a worktree scope and the member the handle resolved through.
type V2 struct {
	SandboxID                 string
	Directory                 string
	ResolvingRuntimeSessionID string
	// The resolving member's tenant: every member checked must have it.
	Tenant Tenant
}

// Tenant is an (org, user); a sandbox, and each of its scopes, has one.
type Tenant struct {
	Org, User string
}

// MemberChecker answers whether runtimeSessionID is a live member root of the scope
// (sandboxID, directory) whose tenant is t. The credential service owns the answer.
type MemberChecker interface {
	IsLiveMember(ctx context.Context, sandboxID, directory, runtimeSessionID string, t Tenant) (bool, error)
}

// Admitter applies the rules above.
type Admitter struct {
	Members MemberChecker
}

// Admit returns nil when md admits target, ErrMismatch when it does not, and an error
// wrapping ErrUnavailable when membership could not be checked.
func (a Admitter) Admit(ctx context.Context, md Metadata, target string) error {
	switch {
	case md.V1 != nil:
		if md.V1.RuntimeSessionID != target {
			return ErrMismatch
		}
		return nil
	case md.V2 != nil:
		// The resolving member first: a handle that resolved through a member that has
		// since left must not keep reaching its siblings.
		for _, id := range uniq(md.V2.ResolvingRuntimeSessionID, target) {
			live, err := a.Members.IsLiveMember(ctx, md.V2.SandboxID, md.V2.Directory, id, md.V2.Tenant)
			if err != nil {
				return fmt.Errorf("%w: %w", ErrUnavailable, err)
			}
			if !live {
				return ErrMismatch
			}
		}
		return nil
	default:
		return nil
	}
}

func uniq(a, b string) []string {
	if a == b {
		return []string{a}
	}
	return []string{a, b}
}
