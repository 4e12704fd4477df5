package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/sandbox/wrapper/acp"
)

// TestAgentSuspendAndResumeContinuesTheConversation (issue 35 item 2,
// DESIGN.md 3.8), with opencode and the fake model: a suspended session
// holds no process (/proc scan); the next message resumes it, and so does
// ResumeSession; each time the agent session/loads the same ACP session, so
// the fake model sees the earlier turns in the resumed turn's request, the
// route keeps one runtime session id, no conversation_restarted event comes,
// and one ExportHistory by session holds every turn, in order.
func TestAgentSuspendAndResumeContinuesTheConversation(t *testing.T) {
	s := startACPSuite(t, "opencode", nil)
	ctx := context.Background()
	sess := s.createAgent(t, "sbx-resume-opencode", "/work/e2e-resume", newSecret(), "opencode")
	id := sess.GetSessionId()
	words := []string{"the first turn says papaya", "the second turn says quince", "the third turn says rambutan"}

	turn := func(messageID, content string) []*sessionv1.SessionEvent {
		t.Helper()
		events, o := s.watchTurn(t, id, messageID, content, nil)
		require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "%s: %s", messageID, o.GetFailureReason())
		return events
	}
	turn("m1", words[0])
	rs := s.routeView(t, id).GetRuntimeSessionId()
	require.NotEmpty(t, rs)
	maps := findFile(t, s.root, "acp-sessions.json")
	require.Len(t, maps, 1)
	acpSession := readSessionMap(t, maps[0])[id]
	require.NotEmpty(t, acpSession)

	// continued checks what the resumed turn n saw and where it went.
	continued := func(events []*sessionv1.SessionEvent, n int) {
		t.Helper()
		prompt := turnRequest(t, s.model.Requests(), words[n]).Prompt
		for _, earlier := range words[:n] {
			require.Contains(t, prompt, earlier, "the resumed turn's model request carries the earlier turns")
		}
		require.Equal(t, rs, s.routeView(t, id).GetRuntimeSessionId(), "the same runtime session goes on")
		require.Equal(t, acpSession, readSessionMap(t, maps[0])[id], "the same ACP session, loaded")
		for _, ev := range events {
			require.NotEqual(t, acp.ConversationRestarted, ev.GetRuntimeEvent().GetText(), "a loaded conversation did not restart")
		}
	}

	_, err := s.suspend(t, id, false)
	require.NoError(t, err)
	s.requireSuspended(t, sess)
	continued(turn("m2", words[1]), 1)

	_, err = s.suspend(t, id, false)
	require.NoError(t, err)
	s.requireSuspended(t, sess)
	rctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	resp, err := s.ses.ResumeSession(rctx, &sessionv1.ResumeSessionRequest{SessionId: id})
	require.NoError(t, err)
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_READY, resp.GetSession().GetRoute().GetState())
	require.Equal(t, rs, resp.GetSession().GetRoute().GetRuntimeSessionId())
	continued(turn("m3", words[2]), 2)

	// One export by session: every turn, in order, under the one runtime
	// session (the history posts after each outcome, so wait for the last).
	require.Eventually(t, func() bool {
		var all strings.Builder
		token := ""
		for {
			resp, err := s.ses.ExportHistory(ctx, &sessionv1.ExportHistoryRequest{SessionId: id, PageToken: token})
			require.NoError(t, err)
			for _, it := range resp.GetItems() {
				require.Equal(t, rs, it.GetRuntimeSessionId(), "one runtime session holds the history")
				all.Write(it.GetItem().GetPayload())
			}
			if token = resp.GetNextPageToken(); token == "" {
				break
			}
		}
		last := -1
		for _, w := range words {
			at := strings.Index(all.String(), w)
			if at <= last {
				return false
			}
			last = at
		}
		return true
	}, time.Minute, 200*time.Millisecond, "every turn, in order, in one export")

	s.deleteSession(t, id)
	require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()))
}
