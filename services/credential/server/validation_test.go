package server

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
)

// Issue 19 item 7: the internal API refuses the ids and directories the
// public one refuses, each with its field violation.
func TestInternalIDsAndPathsValidated(t *testing.T) {
	h := startHarness(t)
	fields := func(err error) []string {
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		require.Equal(t, "INVALID_REQUEST", apierr.Reason(err))
		var out []string
		for _, v := range apierr.FieldViolations(err) {
			out = append(out, v.GetField())
		}
		return out
	}
	for _, ref := range []string{"../x", "..", "cr_a/b", "cr.x"} {
		_, err := h.client.DeleteBackingCredential(bg, &credentialv1.DeleteBackingCredentialRequest{CredentialRef: ref})
		require.Equal(t, []string{"credential_ref"}, fields(err), ref)
	}
	_, err := h.client.MintHandle(bg, &credentialv1.MintHandleRequest{
		Scope:  &credentialv1.Scope{SandboxId: "..", Directory: "../x"},
		Member: &credentialv1.Member{SessionId: "s/..", RuntimeSessionId: "rs:..", UserId: "u..", OrgId: "o/x"}, CredentialRef: "../x",
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Contract: wt, FenceToken: 1,
	})
	require.ElementsMatch(t, []string{"scope.sandbox_id", "scope.directory", "member.session_id", "member.runtime_session_id",
		"member.user_id", "member.org_id", "credential_ref"}, fields(err))
	_, err = h.client.PutBackingCredential(bg, &credentialv1.PutBackingCredentialRequest{SessionId: "..", Secret: "x",
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC})
	require.Equal(t, []string{"session_id"}, fields(err))
	_, err = h.client.ReleaseMember(bg, &credentialv1.ReleaseMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/../x"}, SessionId: "s/..", FenceToken: 1})
	require.ElementsMatch(t, []string{"scope.directory", "session_id"}, fields(err))
	_, err = h.client.CheckScopeMember(bg, &credentialv1.CheckScopeMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"}, RuntimeSessionId: ".."})
	require.Equal(t, []string{"runtime_session_id"}, fields(err))
	_, err = h.client.ResolveHandle(bg, &credentialv1.ResolveHandleRequest{Handle: "aph_x", SandboxId: "../b"})
	require.Equal(t, []string{"sandbox_id"}, fields(err))
}
