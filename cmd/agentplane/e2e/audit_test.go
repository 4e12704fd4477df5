package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/gittest"
	sandbox "agentplane.dev/services/sandbox/server"
)

// listAudit pages a session's whole audit log (pages of 3, to cross page
// boundaries).
func listAudit(t *testing.T, s *suite, sessionID string) []*sessionv1.AuditRecord {
	t.Helper()
	var out []*sessionv1.AuditRecord
	token := ""
	for {
		resp, err := s.ses.ListAuditRecords(context.Background(), &sessionv1.ListAuditRecordsRequest{SessionId: sessionID, PageSize: 3, PageToken: token})
		require.NoError(t, err)
		require.LessOrEqual(t, len(resp.GetRecords()), 3)
		out = append(out, resp.GetRecords()...)
		if token = resp.GetNextPageToken(); token == "" {
			return out
		}
	}
}

// auditLine is a record in a line: turn, then the request (route method
// path status) or the decision (decision host:port xcount).
func auditLine(r *sessionv1.AuditRecord) string {
	if p := r.GetProxyRequest(); p != nil {
		return fmt.Sprintf("%s %s %s %s %d", r.GetTurnId(), p.GetRoute(), p.GetMethod(), p.GetPathTemplate(), p.GetStatus())
	}
	e := r.GetEgress()
	return fmt.Sprintf("%s egress %s %s:%d x%d", r.GetTurnId(), e.GetDecision(), e.GetHost(), e.GetPort(), e.GetCount())
}

// TestAuditPerTurn (issue 36 item 2): one turn of the scripted runtime
// clones its repository through the git route, makes its provider request
// through the proxy and tries two hosts the egress policy denies, one of
// them a host the profile expects denials of, twice. ListAuditRecords
// lists each with that turn's id (the expected denials on one record with
// a count of 2), never a raw path; another tenant's session lists none of
// them; after DeleteSession no audit key of the session is left in Redis.
func TestAuditPerTurn(t *testing.T) {
	const port = 7 // refused before any dial
	s := startSuiteWith(t, nil, func(c *sandbox.Config) {
		c.Egress.Hosts = "denied.test=127.0.0.1,telemetry.test=127.0.0.1"
		c.AgentExpectedDenials = "scripted=telemetry.test"
	})
	token := "ghs_e2e" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/audited.git", map[string]string{"README.md": "hello\n"})
	sess := s.createGit(t, "sbx-audit", "/work/e2e-audit", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/audited.git")}, token)
	id := sess.GetSessionId()

	s.turn(t, id, "m1", fmt.Sprintf("run: curl -sS -m 10 http://denied.test:%d/secret?token=x http://telemetry.test:%d/a http://telemetry.test:%d/b", port, port, port))

	want := []string{
		"m1 git GET {repo}/info/refs 200",
		"m1 git POST {repo}/git-upload-pack 200",
		"m1 provider POST v1/chat/completions 200",
		fmt.Sprintf("m1 egress denied denied.test:%d x1", port),
		fmt.Sprintf("m1 egress denied telemetry.test:%d x2", port),
	}
	var recs []*sessionv1.AuditRecord
	var lines []string
	require.Eventually(t, func() bool { // the proxy reports in batches
		recs = listAudit(t, s, id)
		lines = lines[:0]
		for _, r := range recs {
			lines = append(lines, auditLine(r))
		}
		for _, w := range want {
			if !strings.Contains(strings.Join(lines, "\n"), w) {
				return false
			}
		}
		return true
	}, 30*time.Second, 100*time.Millisecond, "audit records: %v", lines)
	t.Logf("audit records of %s:\n%s", id, strings.Join(lines, "\n"))
	rsid := s.routeView(t, id).GetRuntimeSessionId()
	for _, r := range recs {
		require.Equal(t, "m1", r.GetTurnId(), auditLine(r))
		require.Equal(t, id, r.GetSessionId())
		require.NotEmpty(t, r.GetRuntimeKey(), auditLine(r))
		require.NotEmpty(t, r.GetRecordId())
		require.NotNil(t, r.GetTime())
		if p := r.GetProxyRequest(); p != nil {
			require.Equal(t, sessionv1.AuditKind_AUDIT_KIND_PROXY_REQUEST, r.GetKind())
			require.Equal(t, rsid, r.GetRuntimeSessionId())
			require.NotContains(t, p.GetPathTemplate(), "audited", "no repository in a template")
			require.NotContains(t, p.GetPathTemplate(), "?")
		} else {
			require.Equal(t, sessionv1.AuditKind_AUDIT_KIND_EGRESS, r.GetKind())
			wantExpected := r.GetEgress().GetHost() == "telemetry.test"
			require.Equal(t, wantExpected, r.GetEgress().GetExpected(), auditLine(r))
		}
	}
	var telemetry int
	for _, l := range lines {
		if strings.Contains(l, "telemetry.test") {
			telemetry++
		}
	}
	require.Equal(t, 1, telemetry, "the expected denials are one record: %v", lines)

	// One turn's records; bad input names its field.
	byTurn, err := s.ses.ListAuditRecords(context.Background(), &sessionv1.ListAuditRecordsRequest{SessionId: id, TurnId: "m1", PageSize: 1000})
	require.NoError(t, err)
	require.Len(t, byTurn.GetRecords(), len(recs))
	_, err = s.ses.ListAuditRecords(context.Background(), &sessionv1.ListAuditRecordsRequest{SessionId: id, PageToken: "not-a-token"})
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.Equal(t, "INVALID_REQUEST", apierr.Reason(err))
	require.Equal(t, "page_token", apierr.FieldViolations(err)[0].GetField())

	// Another tenant's session (its own sandbox) lists none of them.
	other, err := createAs(s, &sandboxv1.Tenant{OrgId: "o-other", UserId: "u-other"}, "", "/work/e2e-audit-other")
	require.NoError(t, err)
	s.turn(t, other.GetSessionId(), "b1", "hello")
	for _, r := range listAudit(t, s, other.GetSessionId()) {
		require.Equal(t, "b1", r.GetTurnId(), auditLine(r))
		require.NotContains(t, auditLine(r), "telemetry.test")
		require.NotContains(t, auditLine(r), "git")
	}

	// Deleted with the session.
	s.deleteSession(t, id)
	_, err = s.ses.ListAuditRecords(context.Background(), &sessionv1.ListAuditRecordsRequest{SessionId: id})
	require.Equal(t, codes.NotFound, status.Code(err), "%v", err)
	require.NotNil(t, s.redis, "the suite's private Redis")
	ctx := context.Background()
	iter := s.redis.Scan(ctx, 0, "*", 1000).Iterator()
	var left []string
	for iter.Next(ctx) {
		if k := iter.Val(); strings.Contains(k, "{ses/"+id+"}") && !strings.HasPrefix(k, "ses:wipe:") {
			left = append(left, k)
		}
	}
	require.NoError(t, iter.Err())
	require.Empty(t, left, "keys of the deleted session")
}

// TestAgentAuditPerTurn: a real agent (opencode, kilo) against the fake
// model runs a turn whose shell tool tries a denied host: the turn's
// provider requests (through the wrapper's relay and the proxy) and the
// denial are audit records of that turn, and a denial of a host the
// profile expects (their version checks, kilo's telemetry), if the agent
// made one, is one counted record.
func TestAgentAuditPerTurn(t *testing.T) {
	forEachAgent(t, testAgentAuditPerTurn)
}

func testAgentAuditPerTurn(t *testing.T, agent string) {
	dir := requireAgent(t, agent)
	model := fakemodel.New()
	stk := newStack(t, stackOptions{upstream: model})
	logs := captureStderr(t)
	stopped := stk.runInProcess(func(c *configs) {
		c.sbx.AgentsDir, c.sbx.AgentModel = dir, "fake-model"
		c.sbx.Egress.Hosts = "denied.test=127.0.0.1"
	})
	s := &acpSuite{suite: stk.suite(), model: model}
	s.logs, s.stopped = logs, stopped
	s.turnBound = 5 * time.Minute
	sess := s.createAgent(t, "sbx-audit-"+agent, "/work/e2e-audit-"+agent, newSecret(), agent)
	id := sess.GetSessionId()
	runIn(t, s.suite, id, "m1", "curl", "-sS", "-m", "10", "http://denied.test:7/x")

	var lines []string
	require.Eventually(t, func() bool {
		lines = lines[:0]
		provider, denied := false, false
		for _, r := range listAudit(t, s.suite, id) {
			lines = append(lines, auditLine(r))
			provider = provider || r.GetTurnId() == "m1" && r.GetProxyRequest().GetRoute() == "provider" && r.GetProxyRequest().GetStatus() == 200
			denied = denied || r.GetTurnId() == "m1" && r.GetEgress().GetHost() == "denied.test" && !r.GetEgress().GetExpected()
		}
		return provider && denied
	}, 30*time.Second, 100*time.Millisecond, "audit records: %v", lines)
	t.Logf("audit records of %s (%s):\n%s", id, agent, strings.Join(lines, "\n"))
	hosts := map[string]int{}
	for _, r := range listAudit(t, s.suite, id) {
		// What the agent does after its turn ended (a title request, telemetry) belongs to no turn.
		require.Contains(t, []string{"m1", ""}, r.GetTurnId(), auditLine(r))
		if e := r.GetEgress(); e.GetExpected() {
			hosts[r.GetTurnId()+" "+e.GetHost()+":"+fmt.Sprint(e.GetPort())]++
			require.Positive(t, e.GetCount())
		}
	}
	for h, n := range hosts {
		require.Equal(t, 1, n, "%s: one counted record per turn", h)
	}
}
