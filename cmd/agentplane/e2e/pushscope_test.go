package e2e

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr/apierrtest"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/gittest"
)

// TestWorktreePushScope (issue 36 item 4), against git http-backend:
// PushWorktree to agent/x with an author lands with that author (the
// committer stays agentplane), and a bad author is INVALID_REQUEST naming
// the field. From inside the sandbox, the agent's own git holding its
// handle is refused by the proxy's git route when it force-pushes the
// default branch or deletes a branch: git prints the route's reason, no
// receive-pack reaches the server and the remote's refs are unchanged; the
// same git may still create an agent/ branch.
func TestWorktreePushScope(t *testing.T) {
	s := startSuite(t)
	token := "ghs_scope" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n"})
	remote := filepath.Join(g.Root, "org/app.git")
	sess := s.createGit(t, "sbx-scope", "/work/e2e-scope", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git")}, token)
	id := sess.GetSessionId()
	s.turn(t, id, "m1", "write: NOTES.md notes from the agent")

	ctx := context.Background()
	for field, req := range map[string]*sessionv1.PushWorktreeRequest{
		"author_name":  {SessionId: id, Branch: "agent/x", CommitMessage: "m", AuthorName: "Eve <eve@example.com>"},
		"author_email": {SessionId: id, Branch: "agent/x", CommitMessage: "m", AuthorEmail: "eve at example.com"},
	} {
		_, err := s.ses.PushWorktree(ctx, req)
		apierrtest.RequireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
		requireFieldViolation(t, err, field)
	}

	pushed, err := s.ses.PushWorktree(ctx, &sessionv1.PushWorktreeRequest{SessionId: id, Branch: "agent/x", CommitMessage: "Add notes",
		AuthorName: "Ada Lovelace", AuthorEmail: "ada@example.com"})
	require.NoError(t, err)
	require.True(t, pushed.GetCommitted())
	require.Equal(t, pushed.GetCommitId(), strings.TrimSpace(gittest.Run(t, remote, "rev-parse", "agent/x")))
	require.Equal(t, "Ada Lovelace <ada@example.com>", strings.TrimSpace(gittest.Run(t, remote, "log", "-1", "--format=%an <%ae>", "agent/x")))
	require.Equal(t, "agentplane <agentplane@localhost>", strings.TrimSpace(gittest.Run(t, remote, "log", "-1", "--format=%cn <%ce>", "agent/x")))

	// The agent rewrites history on its own, then tries to overwrite main
	// and to delete the branch just pushed.
	refsBefore := gittest.Run(t, "", "ls-remote", g.AuthURL("org/app.git"))
	seen := len(g.Log())
	requireAgentGit(t, s, id, "m2", 0, "checkout -q --orphan rewrite")
	requireAgentGit(t, s, id, "m3", 0, "-c user.name=agent -c user.email=agent@example.com commit -q -m rewrite")
	out := requireAgentGit(t, s, id, "m4", 1, "push --force origin HEAD:main")
	require.Contains(t, out, "! [remote rejected] HEAD -> main (agentplane: only branches agent/* may be pushed)")
	out = requireAgentGit(t, s, id, "m5", 1, "push origin --delete agent/x")
	require.Contains(t, out, "! [remote rejected] agent/x (agentplane: deleting a ref is not allowed)")
	require.Equal(t, refsBefore, gittest.Run(t, "", "ls-remote", g.AuthURL("org/app.git")), "the remote's refs are unchanged")
	for _, r := range g.Log()[seen:] {
		require.NotContains(t, r.Path, "git-receive-pack", "no refused push reached the git server: %+v", r)
	}

	// The same git, with the same handle, may create an agent/ branch.
	requireAgentGit(t, s, id, "m6", 0, "push -q origin HEAD:agent/rewrite")
	require.Equal(t, "rewrite", strings.TrimSpace(gittest.Run(t, remote, "log", "-1", "--format=%s", "agent/rewrite")))
	require.NotContains(t, s.logs.String(), token)
}

// TestWorktreePushPrefix (issue 36 item 4), against git http-backend: a
// session created with git_credential.push_branch_prefix "team/bot/" shows
// it, PushWorktree to team/bot/x lands, and PushWorktree to agent/x (the
// default namespace, outside this session's) is refused by the git route:
// PUSH_REJECTED, no receive-pack reaches the server, the remote's refs are
// unchanged. A prefix the route could not enforce is INVALID_REQUEST naming
// the field, and no session is stored.
func TestWorktreePushPrefix(t *testing.T) {
	s := startSuite(t)
	token := "ghs_prefix" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n"})
	remote := filepath.Join(g.Root, "org/app.git")
	sess := s.createGitWith(t, "sbx-prefix", "/work/e2e-prefix", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git")},
		&sessionv1.GitCredentialInput{Token: token, PushBranchPrefix: "team/bot/"})
	require.Equal(t, "team/bot/", sess.GetPushBranchPrefix())
	id := sess.GetSessionId()
	s.turn(t, id, "m1", "write: NOTES.md notes from the agent")

	ctx := context.Background()
	pushed, err := s.ses.PushWorktree(ctx, &sessionv1.PushWorktreeRequest{SessionId: id, Branch: "team/bot/x", CommitMessage: "Add notes"})
	require.NoError(t, err)
	require.True(t, pushed.GetCommitted())
	require.Equal(t, pushed.GetCommitId(), strings.TrimSpace(gittest.Run(t, remote, "rev-parse", "team/bot/x")))

	refsBefore := gittest.Run(t, "", "ls-remote", g.AuthURL("org/app.git"))
	seen := len(g.Log())
	_, err = s.ses.PushWorktree(ctx, &sessionv1.PushWorktreeRequest{SessionId: id, Branch: "agent/x", CommitMessage: "unused"})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "PUSH_REJECTED")
	require.Contains(t, status.Convert(err).Message(), "agentplane: only branches team/bot/* may be pushed", "the caller reads the route's reason")
	require.Equal(t, refsBefore, gittest.Run(t, "", "ls-remote", g.AuthURL("org/app.git")), "the remote's refs are unchanged")
	for _, r := range g.Log()[seen:] {
		require.NotContains(t, r.Path, "git-receive-pack", "no refused push reached the git server: %+v", r)
	}

	for _, bad := range []string{"main", "team/../main/", "team bot/"} {
		_, err = s.ses.CreateSession(ctx, &sessionv1.CreateSessionRequest{
			SessionId: "ses-bad-prefix-" + s.run, UserId: "u-e2e", OrgId: "o-e2e",
			Worktree:      &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git"), Directory: "/work/e2e-prefix-bad"},
			Credential:    &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
			GitCredential: &sessionv1.GitCredentialInput{Token: token, PushBranchPrefix: bad},
		})
		apierrtest.RequireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
		requireFieldViolation(t, err, "git_credential.push_branch_prefix")
		require.NotContains(t, err.Error(), token)
	}
	_, err = s.ses.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: "ses-bad-prefix-" + s.run})
	require.Equal(t, codes.NotFound, status.Code(err), "a refused create stores nothing: %v", err)
	require.NotContains(t, s.logs.String(), token)
}

// requireAgentGit has the scripted runtime run git with its handle ("git:")
// in the session's worktree, requires the exit code, and returns git's
// output.
func requireAgentGit(t *testing.T, s *suite, sessionID, messageID string, code int, args string) string {
	t.Helper()
	events := s.turn(t, sessionID, messageID, "git: "+args)
	for _, re := range runtimeEvents(events, messageID)[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT] {
		if re.GetToolName() == "run_command" {
			f := re.GetData().GetFields()
			out := f["output"].GetStringValue()
			require.Equal(t, code, int(f["exit_code"].GetNumberValue()), "git %s: %s", args, out)
			return out
		}
	}
	t.Fatalf("no run_command result for %s", messageID)
	return ""
}

func requireFieldViolation(t *testing.T, err error, field string) {
	t.Helper()
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				if v.GetField() == field {
					return
				}
			}
		}
	}
	t.Fatalf("no field violation %s in %v", field, err)
}
