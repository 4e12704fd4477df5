// Package membership asks the credential service whether a runtime session is a live member
// root of a worktree scope; it implements scope.MemberChecker over gRPC.
package membership

import (
	"context"

	"google.golang.org/grpc"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/services/ingest/internal/scope"
)

// Client is a scope.MemberChecker backed by CredentialService.CheckScopeMember.
type Client struct {
	credential credentialv1.CredentialServiceClient
}

// New returns a checker calling the credential service on conn.
func New(conn grpc.ClientConnInterface) *Client {
	return &Client{credential: credentialv1.NewCredentialServiceClient(conn)}
}

// IsLiveMember implements scope.MemberChecker.
func (c *Client) IsLiveMember(ctx context.Context, sandboxID, directory, runtimeSessionID string, t scope.Tenant) (bool, error) {
	resp, err := c.credential.CheckScopeMember(ctx, &credentialv1.CheckScopeMemberRequest{
		Scope:            &credentialv1.Scope{SandboxId: sandboxID, Directory: directory},
		RuntimeSessionId: runtimeSessionID, OrgId: t.Org, UserId: t.User,
	})
	if err != nil {
		return false, err
	}
	return resp.GetLive(), nil
}
