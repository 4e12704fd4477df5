package server

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
)

// Issue 18 item 6: while Redis is down the credential service answers
// UNAVAILABLE STORE_UNAVAILABLE with RetryInfo, not INTERNAL.
func TestStoreOutageIsUnavailable(t *testing.T) {
	h := startHarness(t)
	ref := h.put(t, "s1", "sk-1", credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC)
	require.NoError(t, h.rdb.Kill())
	ctx := bg
	_, err := h.client.MintHandle(ctx, &credentialv1.MintHandleRequest{
		Scope: &credentialv1.Scope{SandboxId: "sb", Directory: "/w"}, Member: member("s1"), CredentialRef: ref,
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC,
		Contract:        credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE, FenceToken: 7})
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	require.Equal(t, apierr.ReasonStoreUnavailable, apierr.Reason(err))
	_, ok := apierr.RetryDelay(err)
	require.True(t, ok, "RetryInfo")
	_, err = h.client.DeleteBackingCredential(ctx, &credentialv1.DeleteBackingCredentialRequest{CredentialRef: ref})
	require.Equal(t, apierr.ReasonStoreUnavailable, apierr.Reason(err), "%v", err)
	h.rdb.Start(t)
}
