package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	sandbox "agentplane.dev/services/sandbox/server"
)

// scrape reads a /metrics page into "name{labels}" → value.
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	out, err := tryScrape(url)
	require.NoError(t, err)
	return out
}

// tryScrape is scrape for a page that may not be served yet.
func tryScrape(url string) (map[string]float64, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", line, err)
		}
		out[line[:i]] = v
	}
	return out, sc.Err()
}

// sum adds the series of name whose labels contain every one of want (`k="v"`).
func sum(m map[string]float64, name string, want ...string) float64 {
	var total float64
	for k, v := range m {
		if k != name && !strings.HasPrefix(k, name+"{") {
			continue
		}
		ok := true
		for _, w := range want {
			ok = ok && strings.Contains(k, w)
		}
		if ok {
			total += v
		}
	}
	return total
}

// TestMetricsMoveAfterAScriptedScenario scrapes every service's /metrics after a scripted
// scenario — a leaked wrapper found and stopped, a message answered through the proxy, a
// session deleted, a revoked handle refused, and (from a sandbox service restarted with a
// capacity threshold the disk cannot meet) a capacity rejection — and checks each metric
// moved as it should.
func TestMetricsMoveAfterAScriptedScenario(t *testing.T) {
	st := newStack(t, stackOptions{logLevel: "error", logFormat: "text", metrics: true})
	root := st.root
	// the leaked wrapper below carries it: discovery sees only its own deployment
	st.set(svcSandbox, "SANDBOX_DEPLOYMENT", "d-metrics")
	st.runInProcess(nil, svcCredential, svcIngest, svcSession)
	// The sandbox service runs on its own: the capacity step restarts it.
	stopSandbox := st.runInProcess(nil, svcSandbox)

	url := func(s string) string { return st.metricsURL[s] }
	s := st.suite()
	cred := s.cred

	// A leaked wrapper: a process marked as a wrapper of the sandbox that no lease owns.
	// Adopting the sandbox (the first session's Prepare) sweeps, finds and stops it.
	sandboxID := "sbx-metrics-" + s.run
	leak := exec.Command("sleep", "300")
	leak.Env = []string{"AGENTPLANE_SANDBOX=" + sandboxID, "AGENTPLANE_RUNTIME_KEY=leaked-key", "AGENTPLANE_INSTANCE=i-leaked", "AGENTPLANE_GENERATION=1",
		"AGENTPLANE_DEPLOYMENT=d-metrics", "AGENTPLANE_SANDBOX_ROOT=" + root}
	leak.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // its own group: the stop signals the group
	require.NoError(t, leak.Start())
	leakExited := make(chan struct{})
	go func() { _ = leak.Wait(); close(leakExited) }()
	t.Cleanup(func() { _ = leak.Process.Kill() })

	sess := s.create(t, "sbx-metrics", "/work/e2e-metrics", newSecret())
	s.turn(t, sess.GetSessionId(), "m1", "count me")
	select {
	case <-leakExited:
	case <-time.After(60 * time.Second):
		t.Fatal("the leaked wrapper was not stopped")
	}
	require.Eventually(t, func() bool {
		m := scrape(t, url("sandbox"))
		return sum(m, "agentplane_sandbox_leaked_wrappers_stopped_total") >= 1 && sum(m, "agentplane_sandbox_cleanup_duration_seconds_count") >= 1
	}, 30*time.Second, 200*time.Millisecond, "leak stop not counted")
	require.InDelta(t, 1.0, sum(scrape(t, url("session")), "agentplane_session_sessions", `state="active"`), 0, "sessions by state: the one session is active")

	// A handle revoked by scope retirement, then refused by the proxy.
	bg := context.Background()
	static := credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC
	put, err := cred.PutBackingCredential(bg, &credentialv1.PutBackingCredentialRequest{SessionId: "s-rev", CredentialClass: static, Secret: newSecret()})
	require.NoError(t, err)
	sc := &credentialv1.Scope{SandboxId: "sbx-rev-" + s.run, Directory: "/w/rev"}
	minted, err := cred.MintHandle(bg, &credentialv1.MintHandleRequest{Scope: sc, Member: &credentialv1.Member{SessionId: "s-rev", RuntimeSessionId: "rs-rev", UserId: "u", OrgId: "o"},
		CredentialRef: put.GetCredentialRef(), CredentialClass: static, Contract: credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE, FenceToken: 7, AllocationId: "a"})
	require.NoError(t, err)
	proxyCall := func() int {
		req, err := http.NewRequest(http.MethodPost, s.proxy+"/s/"+sc.GetSandboxId()+"/provider/v1/chat/completions", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+minted.GetHandle())
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, proxyCall(), "the live handle is served")
	_, err = cred.RetireScope(bg, &credentialv1.RetireScopeRequest{Scope: sc, Reason: credentialv1.RetireReason_RETIRE_REASON_LAST_MEMBER_LEFT, FenceToken: 7})
	require.NoError(t, err)
	require.Equal(t, http.StatusUnauthorized, proxyCall(), "the revoked handle is refused")

	// Issue 35: a suspend and a resume; the open route's runtime stopped, then running again.
	open := func(runtime string) float64 {
		return sum(scrape(t, url("sandbox")), "agentplane_sandbox_open_routes", `runtime="`+runtime+`"`)
	}
	require.InDelta(t, 1.0, open("running"), 0, "the session's route is open, its runtime running")
	_, err = s.suspend(t, sess.GetSessionId(), false)
	require.NoError(t, err)
	require.InDelta(t, 0.0, open("running"), 0)
	require.InDelta(t, 1.0, open("stopped"), 0, "the suspended route is open, its runtime stopped")
	require.InDelta(t, 1.0, sum(scrape(t, url("session")), "agentplane_session_suspends_total"), 0)
	rctx, rcancel := context.WithTimeout(bg, 90*time.Second)
	_, err = s.ses.ResumeSession(rctx, &sessionv1.ResumeSessionRequest{SessionId: sess.GetSessionId()})
	rcancel()
	require.NoError(t, err)
	require.InDelta(t, 1.0, open("running"), 0, "the resumed runtime runs")
	require.InDelta(t, 1.0, sum(scrape(t, url("session")), "agentplane_session_resumes_total", `result="ready"`), 0)
	require.InDelta(t, 1.0, sum(scrape(t, url("session")), "agentplane_session_resume_duration_seconds_count"), 0)

	// A deletion, after which the session's route and runtime are gone.
	s.deleteSession(t, sess.GetSessionId())

	sbx, ses, crd, ing := scrape(t, url("sandbox")), scrape(t, url("session")), scrape(t, url("credential")), scrape(t, url("ingest"))
	positive := map[string]float64{
		"sandbox leaked found":       sum(sbx, "agentplane_sandbox_leaked_wrappers_found_total", `reason="leaked"`),
		"sandbox leaked stopped":     sum(sbx, "agentplane_sandbox_leaked_wrappers_stopped_total"),
		"sandbox stop attempts":      sum(sbx, "agentplane_sandbox_stop_attempts_total", `result="absent"`),
		"sandbox cleanup latency":    sum(sbx, "agentplane_sandbox_cleanup_duration_seconds_count"),
		"sandbox admissions":         sum(sbx, "agentplane_sandbox_capacity_admissions_total", `result="admitted"`),
		"session created":            sum(ses, "agentplane_session_session_transitions_total", `from="new"`, `to="active"`),
		"session deleting":           sum(ses, "agentplane_session_session_transitions_total", `to="deleting"`),
		"message queued→accepted":    sum(ses, "agentplane_session_message_transitions_total", `from="queued"`, `to="accepted"`),
		"message accepted→completed": sum(ses, "agentplane_session_message_transitions_total", `from="accepted"`, `to="completed"`),
		"deletions deleted":          sum(ses, "agentplane_session_deletion_attempts_total", `result="deleted"`),
		"deletion latency":           sum(ses, "agentplane_session_deletion_duration_seconds_count"),
		"resolutions ok":             sum(crd, "agentplane_credential_resolutions_total", `result="ok"`),
		"resolutions refused":        sum(crd, "agentplane_credential_resolutions_total", `result="unknown_handle"`),
		"revoked handles":            sum(crd, "agentplane_credential_revoked_handles_total"),
		"proxy 200 provider":         sum(crd, "agentplane_credential_proxy_requests_total", `route="provider"`, `code="200"`),
		"proxy 401":                  sum(crd, "agentplane_credential_proxy_requests_total", `code="401"`),
		"proxy ingest":               sum(crd, "agentplane_credential_proxy_requests_total", `route="ingest"`),
		"proxy upstream latency":     sum(crd, "agentplane_credential_proxy_upstream_duration_seconds_count", `route="provider"`),
		"proxy denial unknown":       sum(crd, "agentplane_credential_proxy_denials_total", `reason="unknown_handle"`),
		"ingest items":               sum(ing, "agentplane_ingest_items_total"),
		"ingest bytes":               sum(ing, "agentplane_ingest_bytes_total"),
		"ready (every service)":      sum(sbx, "agentplane_ready") * sum(ses, "agentplane_ready") * sum(crd, "agentplane_ready") * sum(ing, "agentplane_ready"),
	}
	for name, v := range positive {
		require.Positive(t, v, name)
	}
	// What must be back at zero: nothing leaked or exhausted is left, no subscriber or tail open.
	require.Zero(t, sum(sbx, "agentplane_sandbox_leaked_wrappers"), "leaked wrappers known")
	require.Zero(t, sum(sbx, "agentplane_sandbox_exhausted_leases"), "exhausted leases")
	require.Zero(t, sum(ses, "agentplane_session_watch_subscribers"), "watch subscribers after the watches ended")
	require.Zero(t, sum(ing, "agentplane_ingest_tails_open"), "tails")
	require.Zero(t, sum(ses, "agentplane_session_sessions"), "sessions by state after the deletion (every state)")
	require.Contains(t, ses, `agentplane_session_sessions{state="deleting"}`, "the gauge reports every state")
	require.Zero(t, sum(sbx, "agentplane_sandbox_capacity_admissions_total", `result="rejected"`), "no capacity rejection yet")

	// A capacity rejection: the sandbox service again, with a threshold (a setting of the
	// sandbox service) that the disk's free space cannot meet; a cold workspace is refused.
	stopSandbox()
	st.lis[svcSandbox], err = net.Listen("tcp", st.addr[svcSandbox])
	require.NoError(t, err)
	st.runInProcess(func(c *configs) { c.sbx.CapacityThreshold = sandbox.ByteSize(1 << 62) }, svcSandbox)
	cold := s.create(t, "sbx-metrics-cold", "/work/e2e-metrics-cold", newSecret())
	_, err = s.ses.SendMessage(bg, &sessionv1.SendMessageRequest{SessionId: cold.GetSessionId(), MessageId: "m1", Content: "no room"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return s.routeView(t, cold.GetSessionId()).GetFailureReason() == "capacity_rejected"
	}, 60*time.Second, 100*time.Millisecond, "the cold workspace is refused")
	require.Eventually(t, func() bool {
		return sum(scrape(t, url("sandbox")), "agentplane_sandbox_capacity_admissions_total", `result="rejected"`) >= 1
	}, 30*time.Second, 200*time.Millisecond, "the capacity rejection is counted")
	s.deleteSession(t, cold.GetSessionId())
}
