// Package credclient adapts the credential service's gRPC client to the
// driver's credential port (driver.Credentials), converting between the
// credential contract and the driver's domain. A failed call comes back as
// a driver.CredentialError naming the status code the service answered
// (the driver logs the code, never the text), except a member release the
// service answers NOT_FOUND, which is a release.
package credclient

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/control/scope"
)

// Client is driver.Credentials over CredentialService.
type Client struct {
	C credentialv1.CredentialServiceClient
}

var _ driver.Credentials = Client{}

// New is the port over c; nil when c is nil (no credential service: routes
// get no handle), so the driver's nil check sees no typed nil.
func New(c credentialv1.CredentialServiceClient) driver.Credentials {
	if c == nil {
		return nil
	}
	return Client{C: c}
}

func scopeProto(s driver.ScopeRef) *credentialv1.Scope {
	return &credentialv1.Scope{SandboxId: s.SandboxID, Directory: s.Directory}
}

// Mint is MintHandle.
func (c Client) Mint(ctx context.Context, m driver.Mint) (string, bool, error) {
	contract := credentialv1.RuntimeContract_RUNTIME_CONTRACT_PER_SESSION
	if m.Contract == scope.Worktree {
		contract = credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE
	}
	resp, err := c.C.MintHandle(ctx, &credentialv1.MintHandleRequest{
		Scope:         scopeProto(m.Scope),
		Member:        &credentialv1.Member{SessionId: m.SessionID, RuntimeSessionId: m.RuntimeSessionID, UserId: m.UserID, OrgId: m.OrgID},
		CredentialRef: m.CredentialRef, CredentialClass: credentialClasses[m.CredentialClass], Contract: contract,
		FenceToken: m.FenceToken, AllocationId: m.AllocationID, GitCredentialRef: m.GitCredentialRef,
	})
	if err != nil {
		return "", false, failed(err)
	}
	return resp.GetHandle(), resp.GetAdopted(), nil
}

// ReleaseMember is ReleaseMember; NOT_FOUND (nothing left to release) is nil.
func (c Client) ReleaseMember(ctx context.Context, s driver.ScopeRef, sessionID string, fence uint64) error {
	_, err := c.C.ReleaseMember(ctx, &credentialv1.ReleaseMemberRequest{Scope: scopeProto(s), SessionId: sessionID, FenceToken: fence})
	if status.Code(err) == codes.NotFound {
		return nil
	}
	return failed(err)
}

// RetireScope is RetireScope for a wrapper restart.
func (c Client) RetireScope(ctx context.Context, s driver.ScopeRef, fence uint64) error {
	_, err := c.C.RetireScope(ctx, &credentialv1.RetireScopeRequest{
		Scope: scopeProto(s), Reason: credentialv1.RetireReason_RETIRE_REASON_WRAPPER_RESTART, FenceToken: fence})
	return failed(err)
}

// RotateHandle is RotateHandle.
func (c Client) RotateHandle(ctx context.Context, s driver.ScopeRef, fence uint64) (string, time.Time, error) {
	resp, err := c.C.RotateHandle(ctx, &credentialv1.RotateHandleRequest{Scope: scopeProto(s), FenceToken: fence})
	if err != nil {
		return "", time.Time{}, failed(err)
	}
	return resp.GetHandle(), resp.GetPreviousValidUntil().AsTime(), nil
}

// failed is the port's error of a failed call: the service's status code
// named in a driver.CredentialError; an error that carries no status (a
// dial that never got an answer) as it is.
func failed(err error) error {
	s, ok := status.FromError(err)
	if err == nil || !ok {
		return err
	}
	return &driver.CredentialError{Code: s.Code().String(), Err: err}
}

// credentialClasses maps the route's class; any other is UNSPECIFIED.
var credentialClasses = map[string]credentialv1.CredentialClass{
	"delegated": credentialv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED,
	"static":    credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC,
}
