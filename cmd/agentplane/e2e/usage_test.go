package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// usageOf adds up what the fake model reported for reqs.
func usageOf(reqs []fakemodel.Request) *runtimev1.TokenUsage {
	u := &runtimev1.TokenUsage{}
	for _, r := range reqs {
		if r.Usage == (fakemodel.Usage{}) {
			continue
		}
		u.InputTokens += r.Usage.PromptTokens
		u.OutputTokens += r.Usage.CompletionTokens
		u.CachedTokens += r.Usage.CachedTokens
		u.Requests++
	}
	return u
}

func addUsage(a, b *runtimev1.TokenUsage) *runtimev1.TokenUsage {
	return &runtimev1.TokenUsage{InputTokens: a.GetInputTokens() + b.GetInputTokens(), OutputTokens: a.GetOutputTokens() + b.GetOutputTokens(),
		CachedTokens: a.GetCachedTokens() + b.GetCachedTokens(), Requests: a.GetRequests() + b.GetRequests()}
}

func withoutModel(u *runtimev1.TokenUsage) *runtimev1.TokenUsage {
	c := proto.CloneOf(u)
	if c == nil {
		c = &runtimev1.TokenUsage{}
	}
	c.Model = ""
	return c
}

// TestAgentTokenUsage: each pinned agent (opencode, kilo) runs turns against the fake model through
// the credential proxy, which asks its streams for usage and reads every
// reply's; each turn's outcome (as WatchSession shows it) carries the
// tokens the model reported for the turn's requests, GetSession the
// session's totals (every request), and the session service's metrics
// count them under the agent profile and model.
func TestAgentTokenUsage(t *testing.T) {
	forEachAgent(t, testAgentTokenUsage)
}

func testAgentTokenUsage(t *testing.T, agent string) {
	dir := requireAgent(t, agent)
	model := fakemodel.New()
	stk := newStack(t, stackOptions{upstream: model, metrics: true})
	logs := captureStderr(t)
	stopped := stk.runInProcess(func(c *configs) { c.sbx.AgentsDir, c.sbx.AgentModel = dir, "fake-model" })
	s := &acpSuite{suite: stk.suite(), model: model}
	s.logs, s.stopped = logs, stopped
	sess := s.createAgent(t, "sbx-usage-"+agent, "/work/e2e-usage-"+agent, newSecret(), agent)
	sid := sess.GetSessionId()

	_, o1 := s.watchTurn(t, sid, "m1", "Please create hello.txt", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o1.GetResult(), "outcome %v", o1)
	reqs := model.Requests()
	var turn, title []fakemodel.Request
	for _, r := range reqs {
		if len(r.Tools) == 0 {
			title = append(title, r) // the agent's title request runs beside the turn
		} else {
			turn = append(turn, r)
		}
	}
	require.GreaterOrEqual(t, len(turn), 2, "the tool call and the answer")
	for _, r := range turn {
		if r.Stream {
			require.True(t, r.IncludeUsage, "the proxy asked the stream for its usage")
		}
		require.NotZero(t, r.Usage.PromptTokens, "every turn request reported usage")
	}
	// The turn's requests are in its outcome; the title request is in it
	// if it ended before the turn did, else in the next turn's.
	got := withoutModel(o1.GetUsage())
	inTurn, withTitle := usageOf(turn), addUsage(usageOf(turn), usageOf(title))
	require.True(t, proto.Equal(inTurn, got) || proto.Equal(withTitle, got), "turn 1 usage %v; turn requests %v, with the title %v", got, inTurn, withTitle)
	require.Equal(t, "fake-model", o1.GetUsage().GetModel())

	_, o2 := s.watchTurn(t, sid, "m2", "hello", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o2.GetResult(), "outcome %v", o2)
	require.NotZero(t, o2.GetUsage().GetRequests())

	// The session's totals are every request's, and the outcomes add up to
	// them (nothing ran after the second turn).
	var total *runtimev1.TokenUsage
	require.Eventually(t, func() bool {
		resp, err := s.ses.GetSession(context.Background(), &sessionv1.GetSessionRequest{SessionId: sid})
		require.NoError(t, err)
		total = resp.GetSession().GetUsage()
		return proto.Equal(withoutModel(total), usageOf(model.Requests()))
	}, 30*time.Second, 100*time.Millisecond, "totals %v, the model reported %v", total, usageOf(model.Requests()))
	require.True(t, proto.Equal(withoutModel(total), addUsage(o1.GetUsage(), o2.GetUsage())), "totals %v, outcomes %v + %v", total, o1.GetUsage(), o2.GetUsage())

	// The history replays the same outcomes.
	events := s.history(t, sid, "m2")
	var replayed []*runtimev1.TokenUsage
	for _, ev := range events {
		if o := ev.GetOutcome(); o != nil {
			replayed = append(replayed, o.GetUsage())
		}
	}
	require.Len(t, replayed, 2)
	require.True(t, proto.Equal(o1.GetUsage(), replayed[0]) && proto.Equal(o2.GetUsage(), replayed[1]), "replayed %v", replayed)

	// The export holds one usage item per provider response; they add up
	// to the totals.
	fromExport := &runtimev1.TokenUsage{}
	// (A page of 1000, over ingest's 500 a call: the session service
	// pages ingest as needed.)
	resp, err := s.ses.ExportHistory(context.Background(), &sessionv1.ExportHistoryRequest{SessionId: sid, PageSize: 1000})
	require.NoError(t, err)
	for _, it := range resp.GetItems() {
		if !strings.HasPrefix(it.GetItem().GetItemId(), "usage-") {
			continue
		}
		var p struct {
			Status       string `json:"status"`
			Model        string `json:"model"`
			InputTokens  uint64 `json:"input_tokens"`
			OutputTokens uint64 `json:"output_tokens"`
			CachedTokens uint64 `json:"cached_tokens"`
		}
		require.NoError(t, json.Unmarshal(it.GetItem().GetPayload(), &p))
		require.Equal(t, "usage", p.Status)
		require.Equal(t, "fake-model", p.Model)
		require.Equal(t, ingestv1.ItemType_ITEM_TYPE_STATUS, it.GetItem().GetType())
		fromExport.InputTokens += p.InputTokens
		fromExport.OutputTokens += p.OutputTokens
		fromExport.CachedTokens += p.CachedTokens
		fromExport.Requests++
	}
	require.True(t, proto.Equal(withoutModel(total), fromExport), "export %v, totals %v", fromExport, total)

	m := scrape(t, stk.metricsURL[svcSession])
	labels := []string{fmt.Sprintf(`profile=%q`, agent), `model="fake-model"`}
	require.InDelta(t, float64(total.GetInputTokens()), sum(m, "agentplane_session_tokens_total", append(labels, `kind="input"`)...), 0)
	require.InDelta(t, float64(total.GetOutputTokens()), sum(m, "agentplane_session_tokens_total", append(labels, `kind="output"`)...), 0)
	require.InDelta(t, float64(total.GetCachedTokens()), sum(m, "agentplane_session_tokens_total", append(labels, `kind="cached"`)...), 0)
	require.InDelta(t, float64(total.GetRequests()), sum(m, "agentplane_session_provider_requests_total", labels...), 0)
}

// history replays the session's event log from its start up to the
// outcome of lastMessageID.
func (s *acpSuite) history(t *testing.T, sid, lastMessageID string) []*sessionv1.SessionEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sid})
	require.NoError(t, err)
	var out []*sessionv1.SessionEvent
	for {
		resp, err := stream.Recv()
		require.NoError(t, err)
		out = append(out, resp.GetEvent())
		if resp.GetEvent().GetOutcome().GetLastMessageId() == lastMessageID {
			return out
		}
	}
}
