package server

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr/apierrtest"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// TestCreateSessionPushBranchPrefix: git_credential.push_branch_prefix goes
// to the credential service with the git credential (whose route enforces
// it), GetSession shows the prefix in force ("agent/" when none was asked,
// nothing without a repository), repeating the create with another prefix
// is a conflict, and a bad prefix is refused before anything is stored.
func TestCreateSessionPushBranchPrefix(t *testing.T) {
	e := newEnv(t)
	req := func(id, prefix string) *sessionv1.CreateSessionRequest {
		return &sessionv1.CreateSessionRequest{
			SessionId: id, UserId: "u1", OrgId: "org1",
			Worktree:      &sessionv1.Worktree{Directory: "/work/" + id, RepoUrl: "https://example.com/r.git"},
			Credential:    &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-SECRET-" + id},
			GitCredential: &sessionv1.GitCredentialInput{Token: "ghs_TOKEN", PushBranchPrefix: prefix},
		}
	}
	created, err := e.api.CreateSession(e.ctx, req("s1", "team/bot/"))
	require.NoError(t, err)
	require.Equal(t, "team/bot/", created.GetSession().GetPushBranchPrefix())
	sent, ok := e.creds.pushPrefix("gref-s1")
	require.True(t, ok)
	require.Equal(t, "team/bot/", sent)
	got, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Equal(t, "team/bot/", got.GetSession().GetPushBranchPrefix())
	require.NotContains(t, got.String(), "ghs_TOKEN")

	again, err := e.api.CreateSession(e.ctx, req("s1", "team/bot/"))
	require.NoError(t, err)
	require.Equal(t, created.GetSession().GetCreateTime().AsTime(), again.GetSession().GetCreateTime().AsTime())
	_, err = e.api.CreateSession(e.ctx, req("s1", "other/"))
	apierrtest.RequireStatus(t, err, codes.AlreadyExists, "SESSION_ID_CONFLICT")

	def, err := e.api.CreateSession(e.ctx, req("s2", ""))
	require.NoError(t, err)
	require.Equal(t, "agent/", def.GetSession().GetPushBranchPrefix())
	_, err = e.api.CreateSession(e.ctx, req("s2", "agent/"))
	require.NoError(t, err, "the default asked by name is the same session")
	require.Equal(t, "agent/", e.create("s3", "u1", "/work/s3").GetPushBranchPrefix(), "a repository without a git credential")
	norepo := req("s5", "")
	norepo.Worktree.RepoUrl, norepo.GitCredential = "", nil
	plain, err := e.api.CreateSession(e.ctx, norepo)
	require.NoError(t, err)
	require.Empty(t, plain.GetSession().GetPushBranchPrefix(), "no repository: no push")

	_, err = e.api.CreateSession(e.ctx, req("s4", "main"))
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
	_, ok = e.creds.secret("cref-s4")
	require.False(t, ok, "nothing stored for a refused request")
}
