package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// Issue 18 item 5: a session whose sandbox id equals another session's id
// does not block that session's deletion: each service's fence resources
// carry its own prefix, so the sandbox owner lease and the session's
// deletion lease are different keys.
func TestSandboxIDEqualToASessionIDDoesNotBlockItsDeletion(t *testing.T) {
	s := startSuite(t)
	a := s.create(t, "sbx-victim", "/work/e2e-victim", newSecret())
	var b *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: a.GetSessionId(),
			Worktree:   &sessionv1.Worktree{Directory: "/work/e2e-squatter"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
		})
		b = resp.GetSession()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, a.GetSessionId(), b.GetSandboxId())
	s.turn(t, b.GetSessionId(), "m1", "hold the sandbox owner lease") // the sandbox service owns sandbox <a's id> now

	require.Zero(t, s.deleteSession(t, a.GetSessionId()), "a's deletion was never blocked")
	s.deleteSession(t, b.GetSessionId())
}

// Issue 18 item 1 (process level): kill -9 of the sandbox service with
// wrappers up, restart after the wrappers exited (the reconnect window
// passed): the new wrapper's first Hello retires the scope's accepted
// handles (an older owner fence's), so every session of the directory, and
// a new one, completes its next message at once.
func TestRestartPastReconnectWindowRetiresAcceptedHandles(t *testing.T) {
	s, sbx := startProcSuite(t)
	a := s.create(t, "sbx-restart", "/work/e2e-restart", newSecret())
	b := s.create(t, "sbx-restart", "/work/e2e-restart", newSecret())
	s.turn(t, a.GetSessionId(), "m1", "before the crash")
	s.turn(t, b.GetSessionId(), "m1", "before the crash too")
	require.NotEmpty(t, wrapperPIDs(t, a.GetSandboxId()))

	sbx.kill9()
	waitNoWrappers(t, a.GetSandboxId())
	sbx.start()

	s.turn(t, a.GetSessionId(), "m2", "after the restart")
	s.turn(t, b.GetSessionId(), "m2", "after the restart too")
	c := s.create(t, "sbx-restart", "/work/e2e-restart", newSecret())
	s.turn(t, c.GetSessionId(), "m1", "a newcomer")

	for _, id := range []string{a.GetSessionId(), b.GetSessionId(), c.GetSessionId()} {
		s.deleteSession(t, id)
	}
	require.Empty(t, wrapperPIDs(t, a.GetSandboxId()))
}
