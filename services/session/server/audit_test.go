package server

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// The proxy's request reports and the sandbox's egress events become audit
// records of their turn by order: a request that began while a turn ran
// is that turn's even when its report comes after the outcome; one made
// while a message waits is the next turn's. Expected denials are counted
// on one record; records page in order; bad input names its field.
func TestAuditRecordsNameTheirTurn(t *testing.T) {
	e := newEnv(t)
	sbx := e.create("s1", "u1", "/work/repo").GetSandboxId()
	report := func(sandbox, path string, start time.Time) {
		t.Helper()
		_, err := e.notify.NotifyAudit(e.ctx, &sessionv1.NotifyAuditRequest{Reports: []*sessionv1.ProxyRequestReport{{
			SessionId: "s1", SandboxId: sandbox, RuntimeSessionId: "rt-s1", RuntimeKey: "/work/repo", StartTime: timestamppb.New(start),
			Request: &sessionv1.AuditProxyRequest{Route: "provider", Method: "POST", PathTemplate: path, Status: 200, BytesIn: 10, BytesOut: 20},
		}}})
		require.NoError(t, err)
	}
	egress := func(id, host string, expected bool) {
		t.Helper()
		data, err := structpb.NewStruct(map[string]any{"kind": "connect", "host": host, "port": 443, "decision": "denied",
			"reason": "not_allowed", "runtime_key": "/work/repo", "expected": expected})
		require.NoError(t, err)
		_, err = e.notify.NotifyRuntimeEvents(e.ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: e.route("s1", 1), Events: []*runtimev1.RuntimeEvent{{
			EventId: id, RuntimeSessionId: "rt-s1", Kind: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_EGRESS, Data: data,
			Time: timestamppb.New(e.clock.Now())}}})
		require.NoError(t, err)
	}

	e.send("s1", "m1", "first")
	report(sbx, "git/{repo}/info/refs", e.clock.Now()) // the clone while m1 waits: m1's
	e.clock.Add(time.Second)
	e.ready("s1", "w1")
	e.waitState("s1", "m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	e.clock.Add(time.Second)
	during := e.clock.Now()
	report(sbx, "v1/chat/completions", during)
	egress("eg1", "evil.example", false)
	egress("eg1", "evil.example", false) // a repeated event: one record
	for i := range 3 {
		egress("tel"+string(rune('a'+i)), "us.i.posthog.com", true)
	}
	report("another-sandbox", "v1/models", during) // dropped
	e.clock.Add(time.Second)
	_, err := e.notify.NotifyTurnOutcome(e.ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: e.route("s1", 1),
		Outcome: &runtimev1.TurnOutcome{TurnId: "t1", LastMessageId: "m1", Result: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED}})
	require.NoError(t, err)
	report(sbx, "v1/embeddings", during) // reported after the outcome, begun in m1's turn
	e.clock.Add(time.Second)
	e.send("s1", "m2", "second")
	e.waitState("s1", "m2", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	e.clock.Add(time.Second)
	report(sbx, "v1/chat/completions", e.clock.Now())
	egress("tel-m2", "us.i.posthog.com", true)

	var all []*sessionv1.AuditRecord
	token := ""
	for {
		resp, err := e.api.ListAuditRecords(e.ctx, &sessionv1.ListAuditRecordsRequest{SessionId: "s1", PageSize: 2, PageToken: token})
		require.NoError(t, err)
		require.LessOrEqual(t, len(resp.GetRecords()), 2)
		all = append(all, resp.GetRecords()...)
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	type row struct {
		turn, what string
		count      uint64
	}
	var got []row
	for _, r := range all {
		require.Equal(t, "s1", r.GetSessionId())
		require.Equal(t, "/work/repo", r.GetRuntimeKey())
		require.NotEmpty(t, r.GetRecordId())
		if p := r.GetProxyRequest(); p != nil {
			require.Equal(t, sessionv1.AuditKind_AUDIT_KIND_PROXY_REQUEST, r.GetKind())
			got = append(got, row{r.GetTurnId(), p.GetPathTemplate(), 0})
			continue
		}
		require.Equal(t, sessionv1.AuditKind_AUDIT_KIND_EGRESS, r.GetKind())
		got = append(got, row{r.GetTurnId(), r.GetEgress().GetHost(), r.GetEgress().GetCount()})
	}
	require.Equal(t, []row{
		{"m1", "git/{repo}/info/refs", 0},
		{"m1", "v1/chat/completions", 0},
		{"m1", "evil.example", 1},
		{"m1", "us.i.posthog.com", 3},
		{"m1", "v1/embeddings", 0},
		{"m2", "v1/chat/completions", 0},
		{"m2", "us.i.posthog.com", 1},
	}, got)

	// One turn's records.
	resp, err := e.api.ListAuditRecords(e.ctx, &sessionv1.ListAuditRecordsRequest{SessionId: "s1", TurnId: "m2"})
	require.NoError(t, err)
	require.Len(t, resp.GetRecords(), 2)

	// Expected denials are counted, not logged one by one as events.
	stream, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	egress("last", "evil2.example", false) // a marker after everything
	var hosts []string
	for {
		ev, err := stream.Recv()
		require.NoError(t, err)
		if re := ev.GetEvent().GetRuntimeEvent(); re != nil {
			host := re.GetData().GetFields()["host"].GetStringValue()
			hosts = append(hosts, host)
			if host == "evil2.example" {
				break
			}
		}
	}
	require.Equal(t, []string{"evil.example", "evil2.example"}, hosts)

	for name, c := range map[string]struct {
		req   *sessionv1.ListAuditRecordsRequest
		code  codes.Code
		field string
	}{
		"page size":       {&sessionv1.ListAuditRecordsRequest{SessionId: "s1", PageSize: 1001}, codes.InvalidArgument, "page_size"},
		"negative size":   {&sessionv1.ListAuditRecordsRequest{SessionId: "s1", PageSize: -1}, codes.InvalidArgument, "page_size"},
		"token":           {&sessionv1.ListAuditRecordsRequest{SessionId: "s1", PageToken: "!!"}, codes.InvalidArgument, "page_token"},
		"token not ours":  {&sessionv1.ListAuditRecordsRequest{SessionId: "s1", PageToken: "YWJj"}, codes.InvalidArgument, "page_token"},
		"session id":      {&sessionv1.ListAuditRecordsRequest{SessionId: "a b"}, codes.InvalidArgument, "session_id"},
		"turn id":         {&sessionv1.ListAuditRecordsRequest{SessionId: "s1", TurnId: "a/b"}, codes.InvalidArgument, "turn_id"},
		"unknown session": {&sessionv1.ListAuditRecordsRequest{SessionId: "nope"}, codes.NotFound, ""},
	} {
		_, err := e.api.ListAuditRecords(e.ctx, c.req)
		require.Equal(t, c.code, status.Code(err), "%s: %v", name, err)
		require.NotEmpty(t, apierr.Reason(err), name)
		if c.field != "" {
			var fields []string
			for _, v := range apierr.FieldViolations(err) {
				fields = append(fields, v.GetField())
			}
			require.Contains(t, fields, c.field, name)
		}
	}
	_, err = e.notify.NotifyAudit(e.ctx, &sessionv1.NotifyAuditRequest{Reports: []*sessionv1.ProxyRequestReport{{SessionId: "s1"}}})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Contains(t, err.Error(), "reports.request")
}
