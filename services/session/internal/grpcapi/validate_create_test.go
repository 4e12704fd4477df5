package grpcapi

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// TestValidateCreatePushPrefix: git_credential.push_branch_prefix is
// optional; one the credential service's git route would refuse is
// INVALID_REQUEST with a field violation naming it.
func TestValidateCreatePushPrefix(t *testing.T) {
	create := func(prefix string) *sessionv1.CreateSessionRequest {
		return &sessionv1.CreateSessionRequest{UserId: "u1", OrgId: "o1",
			Worktree:      &sessionv1.Worktree{Directory: "/work/repo", RepoUrl: "https://example.com/r.git"},
			Credential:    &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-1"},
			GitCredential: &sessionv1.GitCredentialInput{Token: "ghs_1", PushBranchPrefix: prefix}}
	}
	for _, ok := range []string{"", "agent/", "team/bot/", strings.Repeat("p", 99) + "/"} {
		require.NoError(t, validateCreate(create(ok)), "%q", ok)
	}
	for _, bad := range []string{
		"main", "agent", "/", "/agent/", "a//", "../", "a/../b/", ".hidden/", "x.lock/", "a@{/", "a b/", "a~/", "a:/",
		"a\n/", "a\x00/", strings.Repeat("p", 100) + "/",
	} {
		st := status.Convert(toStatus(context.Background(), nil, validateCreate(create(bad))))
		require.Equal(t, codes.InvalidArgument, st.Code(), "%q", bad)
		var reason string
		var fields []string
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *errdetails.ErrorInfo:
				reason = d.GetReason()
			case *errdetails.BadRequest:
				for _, v := range d.GetFieldViolations() {
					fields = append(fields, v.GetField())
				}
			}
		}
		require.Equal(t, ReasonInvalidRequest, reason, "%q", bad)
		require.Equal(t, []string{"git_credential.push_branch_prefix"}, fields, "%q", bad)
	}
}
