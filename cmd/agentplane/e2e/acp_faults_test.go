package e2e

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	"agentplane.dev/pkg/apierr/apierrtest"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	sandbox "agentplane.dev/services/sandbox/server"
)

// TestACPAgentFaults (issue 17): a hostile agent behind the generic acp
// profile (fakeacp, built here) on its own worktree: non-JSON on stdout,
// no answer to initialize (bounded by --agent-init-timeout), a prompt
// answered twice, an exit mid-turn. Each ends with a named reason within
// a bound, and a session of the same sandbox on another worktree keeps
// working after each; another model in its worktree is refused at
// CreateSession.
func TestACPAgentFaults(t *testing.T) {
	bin := buildFakeACP(t)
	s := &acpSuite{suite: startSuiteWith(t, fakemodel.New(), func(c *sandbox.Config) {
		c.AgentACP, c.WrapperArgs = bin, "--agent-init-timeout=3s"
	})}
	healthy := s.createAgent(t, "sbx-fault", "/work/fault-ok", newSecret(), "acp")
	turnOK := func(messageID string) {
		t.Helper()
		_, o := s.watchTurn(t, healthy.GetSessionId(), messageID, "hello", nil)
		require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "the healthy session: %v", o)
	}
	turnOK("h0")
	v := s.routeView(t, healthy.GetSessionId())
	require.Equal(t, "acp", v.GetAgent().GetProfile(), "the route reports the agent it runs")
	require.Equal(t, healthy.GetAgent().GetModel(), v.GetAgent().GetModel())

	// Another model in the same worktree is not silently served by the
	// running agent: CreateSession refuses it AGENT_MISMATCH (docs/errors.md;
	// it used to fail the route at the first message), the first goes on.
	_, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
		UserId: "u-e2e", OrgId: "o-e2e", SandboxId: "sbx-fault-" + s.run, Worktree: &sessionv1.Worktree{Directory: "/work/fault-ok"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
		Agent:      &sessionv1.Agent{Profile: "acp", Model: "another-model"},
	})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "AGENT_MISMATCH")
	turnOK("h00")

	for i, tc := range []struct {
		name, dir, prompt string
		// The turn's outcome and its reason; none when the turn never
		// started (the message fails route_failed, the route names why).
		result     runtimev1.TurnResult
		turnReason string
		// The route's failure reason (retryable: a new agent next time).
		routeReason string
	}{
		{"non-JSON output", "/work/fault-garbage", "fault garbage", runtimev1.TurnResult_TURN_RESULT_FAILED, "agent_protocol_error", "agent_protocol_error"},
		{"exit mid-turn", "/work/fault-exit", "fault exit", runtimev1.TurnResult_TURN_RESULT_FAILED, "agent_exited", "agent_exited"},
		// The first answer settles the turn; the second breaks the
		// connection, and the route fails with the protocol error.
		{"prompt answered twice", "/work/fault-twice", "fault twice", runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, "", "agent_protocol_error"},
		{"initialize never answered", "/work/fault-silent-init", "hello", runtimev1.TurnResult_TURN_RESULT_UNSPECIFIED, "", "agent_initialize_timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sess := s.createAgent(t, "sbx-fault", tc.dir, newSecret(), "acp")
			var outcomes []*runtimev1.TurnOutcome
			var routeFailed *sessionv1.RouteView
			var failedMsg *sessionv1.Message
			s.watchUntil(t, sess.GetSessionId(), "m1", tc.prompt, func(ev *sessionv1.SessionEvent) bool {
				if o := ev.GetOutcome(); o != nil && o.GetLastMessageId() == "m1" {
					outcomes = append(outcomes, o)
				}
				if r := ev.GetRoute(); r != nil && r.GetState() == sessionv1.RouteState_ROUTE_STATE_FAILED {
					routeFailed = r
				}
				if m := ev.GetMessage(); m != nil && m.GetMessageId() == "m1" && m.GetState() == sessionv1.MessageState_MESSAGE_STATE_FAILED {
					failedMsg = m
				}
				turnDone := len(outcomes) > 0 || (tc.result == runtimev1.TurnResult_TURN_RESULT_UNSPECIFIED && failedMsg != nil)
				return turnDone && routeFailed != nil
			})
			require.Equal(t, tc.routeReason, routeFailed.GetFailureReason())
			if tc.result == runtimev1.TurnResult_TURN_RESULT_UNSPECIFIED {
				require.Empty(t, outcomes, "no turn started")
				// Decision 38: the message fails route_failed, the route view names the cause.
				require.Equal(t, "route_failed", failedMsg.GetFailureReason())
			} else {
				require.Len(t, outcomes, 1, "exactly one outcome")
				require.Equal(t, tc.result, outcomes[0].GetResult(), "outcome %v", outcomes[0])
				require.Equal(t, tc.turnReason, outcomes[0].GetFailureReason())
			}
			turnOK("h" + string(rune('1'+i)))
		})
	}
}
