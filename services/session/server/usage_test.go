package server

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// The credential proxy's usage reports add up: each turn outcome carries
// the usage reported since the previous one (WatchSession shows it), and
// GetSession the session's totals.
func TestUsageReportsReachOutcomesAndTotals(t *testing.T) {
	e := newEnv(t)
	sbx := e.create("s1", "u1", "/work/repo").GetSandboxId()
	stream, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	report := func(sid, sandbox string, in, out, cached uint64, model string) error {
		_, err := e.notify.NotifyUsage(e.ctx, &sessionv1.NotifyUsageRequest{SessionId: sid, SandboxId: sandbox, RuntimeSessionId: "rt-" + sid,
			Usage: &runtimev1.TokenUsage{InputTokens: in, OutputTokens: out, CachedTokens: cached, Requests: 1, Model: model}})
		return err
	}
	outcome := func(turn, mid string) {
		_, err := e.notify.NotifyTurnOutcome(e.ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: e.route("s1", 1),
			Outcome: &runtimev1.TurnOutcome{TurnId: turn, LastMessageId: mid, Result: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED}})
		require.NoError(t, err)
	}

	e.send("s1", "m1", "first")
	e.ready("s1", "w1")
	e.waitState("s1", "m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	require.NoError(t, report("s1", sbx, 10, 5, 2, "m-a"))
	require.NoError(t, report("s1", sbx, 20, 7, 0, "m-b"))
	require.NoError(t, report("s1", "other-sandbox", 1000, 1000, 0, "m-x"), "another sandbox's report is dropped")
	require.NoError(t, report("nobody", sbx, 1000, 1000, 0, "m-x"), "an unknown session's report is dropped")
	outcome("t1", "m1")
	e.send("s1", "m2", "second")
	e.waitState("s1", "m2", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	outcome("t2", "m2") // no request in this turn
	e.send("s1", "m3", "third")
	e.waitState("s1", "m3", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	require.NoError(t, report("s1", sbx, 3, 1, 1, ""))
	outcome("t3", "m3")

	var got []*runtimev1.TokenUsage
	for len(got) < 3 {
		resp, err := stream.Recv()
		require.NoError(t, err)
		if o, ok := resp.GetEvent().GetKind().(*sessionv1.SessionEvent_Outcome); ok {
			got = append(got, o.Outcome.GetUsage())
		}
	}
	want := []*runtimev1.TokenUsage{
		{InputTokens: 30, OutputTokens: 12, CachedTokens: 2, Requests: 2, Model: "m-b"},
		nil,
		{InputTokens: 3, OutputTokens: 1, CachedTokens: 1, Requests: 1},
	}
	for i := range want {
		require.True(t, proto.Equal(want[i], got[i]), "outcome %d: %v", i+1, got[i])
	}
	s, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.True(t, proto.Equal(&runtimev1.TokenUsage{InputTokens: 33, OutputTokens: 13, CachedTokens: 3, Requests: 3, Model: "m-b"},
		s.GetSession().GetUsage()), "%v", s.GetSession().GetUsage())

	// A bad report is refused with the field named.
	err = report("s1", sbx, 1, 1, 2, "m")
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.NotEmpty(t, apierr.Reason(err))
	require.Contains(t, err.Error(), "usage.cached_tokens")
}

// With a price table, each outcome and the totals carry the cost of the
// responses whose model it prices (cached prompt tokens at their price).
func TestUsageCostFromThePriceTable(t *testing.T) {
	e := newEnv(t, func(c *Config) {
		c.PriceTable = `{"m-a":{"input":2,"output":8,"cached":0.5},"*":{"input":1,"output":1,"cached":1}}`
	})
	sbx := e.create("s1", "u1", "/work/repo").GetSandboxId()
	stream, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	e.send("s1", "m1", "first")
	e.ready("s1", "w1")
	e.waitState("s1", "m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	for _, u := range []*runtimev1.TokenUsage{
		{InputTokens: 1_000_000, OutputTokens: 500_000, CachedTokens: 400_000, Requests: 1, Model: "m-a"}, // 0.6*2 + 0.4*0.5 + 0.5*8 = 5.4
		{InputTokens: 1_000_000, OutputTokens: 1_000_000, Requests: 1, Model: "m-other"},                  // 1 + 1 = 2
	} {
		_, err := e.notify.NotifyUsage(e.ctx, &sessionv1.NotifyUsageRequest{SessionId: "s1", SandboxId: sbx, Usage: u})
		require.NoError(t, err)
	}
	_, err = e.notify.NotifyTurnOutcome(e.ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: e.route("s1", 1),
		Outcome: &runtimev1.TurnOutcome{TurnId: "t1", LastMessageId: "m1", Result: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED}})
	require.NoError(t, err)
	for {
		resp, err := stream.Recv()
		require.NoError(t, err)
		if o := resp.GetEvent().GetOutcome(); o != nil {
			require.InDelta(t, 7.4, o.GetUsage().GetCostUsd(), 1e-9)
			break
		}
	}
	s, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.InDelta(t, 7.4, s.GetSession().GetUsage().GetCostUsd(), 1e-9)
}

// A bad price table stops the service at start, naming the setting.
func TestPriceTableIsValidated(t *testing.T) {
	for _, bad := range []string{`{`, `{"m":{"input":-1}}`, `{"m":{"inptu":1}}`, `{"":{}}`, `[]`} {
		c := DefaultConfig()
		c.PriceTable = bad
		err := c.Validate()
		require.Error(t, err, bad)
		require.Contains(t, err.Error(), "SESSION_PRICE_TABLE", bad)
	}
}
