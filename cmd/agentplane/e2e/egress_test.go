package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/testaddr"
	sandbox "agentplane.dev/services/sandbox/server"
)

// egressSuite is the four services with the boundary, an HTTP and a TLS
// server on host loopback, and the egress proxy's name map (standing in
// for DNS) pointing test names at them — and one at a private address.
type egressSuite struct {
	*suite
	metrics         string
	plain, tls      *httptest.Server
	httpPort, tPort uint32
}

// egressHosts is the egress proxy's name map of the egress tests.
const egressHosts = "allowed.test=127.0.0.1,denied.test=127.0.0.1,other.test=127.0.0.1,private.test=10.255.0.1"

func startEgressSuite(t *testing.T) *egressSuite { return startEgressSuiteTuned(t, nil) }

// startEgressSuiteTuned is startEgressSuite with a hook that adjusts the
// sandbox configuration further.
func startEgressSuiteTuned(t *testing.T, tune func(*sandbox.Config)) *egressSuite {
	e := startEgressServers(t)
	metricsAddr := testaddr.Addr(t)
	e.metrics = "http://" + metricsAddr + "/metrics"
	e.suite = startSuiteWith(t, nil, func(c *sandbox.Config) {
		c.MetricsAddr = metricsAddr
		c.Egress.Hosts = egressHosts
		if tune != nil {
			tune(c)
		}
	})
	return e
}

// startEgressServers is the suite's HTTP and TLS servers, without services.
func startEgressServers(t *testing.T) *egressSuite {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "egress-ok "+r.Host) })
	e := &egressSuite{plain: httptest.NewServer(h), tls: httptest.NewTLSServer(h)}
	t.Cleanup(e.plain.Close)
	t.Cleanup(e.tls.Close)
	e.httpPort = uint32(e.plain.Listener.Addr().(*net.TCPAddr).Port)
	e.tPort = uint32(e.tls.Listener.Addr().(*net.TCPAddr).Port)
	return e
}

// policy allows allowed.test on both servers' ports and private.test, and
// names 127.0.0.1 as an address allowed names may lead to: every name of
// the map points at loopback, which egress refuses unless named.
func (e *egressSuite) policy(extra ...*sessionv1.EgressRule) *sessionv1.EgressPolicy {
	return &sessionv1.EgressPolicy{
		Allow: append([]*sessionv1.EgressRule{
			{Host: "allowed.test", Ports: []uint32{e.httpPort, e.tPort}},
			{Host: "private.test", Ports: []uint32{e.httpPort}},
		}, extra...),
		PrivateNetworks: []string{"127.0.0.1"},
	}
}

// createSession creates a session of sandboxID on directory under the
// suite's policy, retrying while the services come up.
func (e *egressSuite) createSession(t *testing.T, sandboxID, directory string) *sessionv1.Session {
	t.Helper()
	var sess *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := e.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: sandboxID,
			Worktree:   &sessionv1.Worktree{Directory: directory},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
			Egress:     e.policy(),
		})
		sess = resp.GetSession()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	return sess
}

// runIn has the scripted runtime run argv inside the sandbox and returns
// its exit code and output.
func (e *egressSuite) runIn(t *testing.T, sessionID, messageID string, argv ...string) (int, string) {
	t.Helper()
	events := e.turn(t, sessionID, messageID, "run: "+strings.Join(argv, " "))
	for _, re := range runtimeEvents(events, messageID)[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT] {
		if re.GetToolName() == "run_command" {
			f := re.GetData().GetFields()
			return int(f["exit_code"].GetNumberValue()), f["output"].GetStringValue()
		}
	}
	t.Fatalf("no run_command result for %s", messageID)
	return 0, ""
}

// egressEvents watches the session from its start until every one of want
// ("decision/reason/host") was audited, and returns what was.
func (e *egressSuite) egressEvents(t *testing.T, sessionID string, want ...string) map[string]*runtimev1.RuntimeEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := e.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sessionID})
	require.NoError(t, err)
	seen := map[string]*runtimev1.RuntimeEvent{}
	missing := func() []string {
		var out []string
		for _, w := range want {
			if seen[w] == nil {
				out = append(out, w)
			}
		}
		return out
	}
	for len(missing()) > 0 {
		resp, err := stream.Recv()
		require.NoError(t, err, "egress events still missing: %v (seen %v)", missing(), keys(seen))
		re := resp.GetEvent().GetRuntimeEvent()
		if re.GetKind() != runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_EGRESS {
			continue
		}
		f := re.GetData().GetFields()
		seen[f["decision"].GetStringValue()+"/"+f["reason"].GetStringValue()+"/"+f["host"].GetStringValue()] = re
	}
	return seen
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func (e *egressSuite) url(scheme, host string, port uint32) string {
	return fmt.Sprintf("%s://%s:%d/x", scheme, host, port)
}

// TestEgressByPolicy is issue 25's acceptance: from inside the boundary,
// curl reaches an allowed name over plain HTTP and over HTTPS through
// CONNECT; a denied name, a raw IP, a name leading to a private address and
// a CONNECT whose SNI differs from its host are refused, each audited on
// the session and counted; UpdateEgressPolicy allows a new name for the
// next connection and a removal denies it again; dialing past the proxy
// reaches nothing.
func TestEgressByPolicy(t *testing.T) {
	e := startEgressSuite(t)
	sess := e.createSession(t, "egress-"+e.run, "/repo/egress")
	id := sess.GetSessionId()
	require.Equal(t, uint64(1), sess.GetEgressVersion())
	require.Eventually(t, func() bool {
		resp, err := http.Get(e.metrics)
		if err == nil {
			_ = resp.Body.Close()
		}
		return err == nil
	}, 30*time.Second, 50*time.Millisecond, "the sandbox service's /metrics")
	before := scrape(t, e.metrics)
	decisions := func(m map[string]float64, decision, reason string) float64 {
		return sum(m, "agentplane_sandbox_egress_decisions_total", `decision="`+decision+`"`, `reason="`+reason+`"`)
	}

	curl := []string{"curl", "-sS", "-m", "15"}
	code, out := e.runIn(t, id, "m1", append(curl, e.url("http", "allowed.test", e.httpPort))...)
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "egress-ok allowed.test:")
	code, out = e.runIn(t, id, "m2", append(curl, "-k", e.url("https", "allowed.test", e.tPort))...)
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "egress-ok allowed.test:")

	code, out = e.runIn(t, id, "m3", append(curl, e.url("http", "denied.test", e.httpPort))...)
	require.Contains(t, out, "denied (not_allowed)", "exit %d", code)
	code, out = e.runIn(t, id, "m4", append(curl, "-k", e.url("https", "denied.test", e.tPort))...)
	require.NotEqual(t, 0, code, out)
	require.Contains(t, out, "403", "CONNECT refused")
	code, out = e.runIn(t, id, "m5", append(curl, e.url("http", "10.255.0.1", e.httpPort))...)
	require.Contains(t, out, "denied (ip_literal)", "exit %d", code)
	code, out = e.runIn(t, id, "m6", append(curl, e.url("http", "private.test", e.httpPort))...)
	require.Contains(t, out, "denied (private_address)", "exit %d", code)
	// CONNECT allowed.test, ClientHello for other.test.
	code, out = e.runIn(t, id, "m7", "openssl", "s_client", "-proxy", "127.0.0.1:7406",
		"-connect", fmt.Sprintf("allowed.test:%d", e.tPort), "-servername", "other.test")
	require.NotContains(t, out, "BEGIN CERTIFICATE", "exit %d: the handshake never reached the server", code)

	// Past the proxy: the server's real address, and the name without the proxy.
	code, out = e.runIn(t, id, "m8", append(curl, "--noproxy", "*", e.plain.URL)...)
	require.NotEqual(t, 0, code, out)
	require.NotContains(t, out, "egress-ok")
	code, out = e.runIn(t, id, "m9", append(curl, "--noproxy", "*", e.url("http", "allowed.test", e.httpPort))...)
	require.NotEqual(t, 0, code, out)

	// A new name for the next connection, then removed.
	code, out = e.runIn(t, id, "m10", append(curl, e.url("http", "other.test", e.httpPort))...)
	require.Contains(t, out, "denied (not_allowed)", "exit %d", code)
	_, err := e.ses.UpdateEgressPolicy(context.Background(), &sessionv1.UpdateEgressPolicyRequest{
		SessionId: id, ExpectedVersion: 1, Egress: e.policy(&sessionv1.EgressRule{Host: "*.test", Ports: []uint32{e.httpPort}})})
	require.Equal(t, codes.InvalidArgument, status.Code(err), "*.test: a wildcard of one label")
	up, err := e.ses.UpdateEgressPolicy(context.Background(), &sessionv1.UpdateEgressPolicyRequest{
		SessionId: id, ExpectedVersion: 1, Egress: e.policy(&sessionv1.EgressRule{Host: "other.test", Ports: []uint32{e.httpPort}})})
	require.NoError(t, err)
	require.Equal(t, uint64(2), up.GetVersion())
	code, out = e.runIn(t, id, "m11", append(curl, e.url("http", "other.test", e.httpPort))...)
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "egress-ok other.test:")
	_, err = e.ses.UpdateEgressPolicy(context.Background(), &sessionv1.UpdateEgressPolicyRequest{SessionId: id, ExpectedVersion: 1, Egress: e.policy()})
	require.Equal(t, codes.Aborted, status.Code(err), "a stale expected_version")
	_, err = e.ses.UpdateEgressPolicy(context.Background(), &sessionv1.UpdateEgressPolicyRequest{SessionId: id, ExpectedVersion: 2, Egress: e.policy()})
	require.NoError(t, err)
	code, out = e.runIn(t, id, "m12", append(curl, e.url("http", "other.test", e.httpPort))...)
	require.Contains(t, out, "denied (not_allowed)", "exit %d", code)

	seen := e.egressEvents(t, id, "allowed/policy/allowed.test", "denied/not_allowed/denied.test", "denied/ip_literal/10.255.0.1",
		"denied/private_address/private.test", "denied/sni_mismatch/allowed.test", "allowed/policy/other.test", "denied/not_allowed/other.test")
	ok := seen["allowed/policy/allowed.test"].GetData().GetFields()
	require.Positive(t, ok["bytes_down"].GetNumberValue())
	require.Positive(t, ok["bytes_up"].GetNumberValue())
	require.InDelta(t, float64(e.httpPort), seen["denied/private_address/private.test"].GetData().GetFields()["port"].GetNumberValue(), 0)

	after := scrape(t, e.metrics)
	for reason, n := range map[string]float64{"not_allowed": 4, "ip_literal": 1, "private_address": 1, "sni_mismatch": 1} {
		require.GreaterOrEqual(t, decisions(after, "denied", reason)-decisions(before, "denied", reason), n, reason)
	}
	require.GreaterOrEqual(t, decisions(after, "allowed", "policy")-decisions(before, "allowed", "policy"), 3.0)
}

// TestEgressPolicyBadInput: an invalid pattern, an empty wildcard and a
// policy over SESSION_EGRESS_MAX_RULES are INVALID_ARGUMENT with field
// violations, at CreateSession and at UpdateEgressPolicy; nothing is
// applied.
func TestEgressPolicyBadInput(t *testing.T) {
	s := startSuite(t)
	sess := s.create(t, "egress-bad", "/repo/egress-bad", newSecret())
	good := &sessionv1.EgressPolicy{Allow: []*sessionv1.EgressRule{{Host: "packages.example.com"}}}
	require.Eventually(t, func() bool { // once the sandbox service answers
		_, err := s.ses.UpdateEgressPolicy(context.Background(), &sessionv1.UpdateEgressPolicyRequest{SessionId: sess.GetSessionId(), Egress: good})
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	big := &sessionv1.EgressPolicy{}
	for i := range 257 {
		big.Allow = append(big.Allow, &sessionv1.EgressRule{Host: "h" + strconv.Itoa(i) + ".example.com"})
	}
	for name, c := range map[string]struct {
		p     *sessionv1.EgressPolicy
		field string
	}{
		"invalid pattern": {&sessionv1.EgressPolicy{Allow: []*sessionv1.EgressRule{{Host: "ok.example"}, {Host: "Bad_Host.example"}}}, "egress.allow[1].host"},
		"empty wildcard":  {&sessionv1.EgressPolicy{Allow: []*sessionv1.EgressRule{{Host: "*."}}}, "egress.allow[0].host"},
		"bad port":        {&sessionv1.EgressPolicy{Allow: []*sessionv1.EgressRule{{Host: "a.example", Ports: []uint32{70000}}}}, "egress.allow[0].ports[0]"},
		"bad network":     {&sessionv1.EgressPolicy{PrivateNetworks: []string{"10.0.0.0/33"}}, "egress.private_networks[0]"},
		"oversized":       {big, "egress.allow"},
	} {
		_, err := s.ses.UpdateEgressPolicy(context.Background(), &sessionv1.UpdateEgressPolicyRequest{SessionId: sess.GetSessionId(), Egress: c.p})
		requireViolation(t, err, c.field, name)
		_, err = s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", Worktree: &sessionv1.Worktree{Directory: "/repo/egress-bad2"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
			Egress:     c.p,
		})
		requireViolation(t, err, c.field, name)
	}
	got, err := s.ses.GetSession(context.Background(), &sessionv1.GetSessionRequest{SessionId: sess.GetSessionId()})
	require.NoError(t, err)
	require.Equal(t, uint64(2), got.GetSession().GetEgressVersion(), "nothing applied")
	require.Equal(t, "packages.example.com", got.GetSession().GetEgress().GetAllow()[0].GetHost())
}

func requireViolation(t *testing.T, err error, field, name string) {
	t.Helper()
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", name, err)
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				if v.GetField() == field {
					return
				}
			}
		}
	}
	t.Fatalf("%s: no field violation %q in %v", name, field, st.Details())
}

// TestEgressPolicyChangedWhileSuspendedAppliesOnResume (issue 35 item 2:
// "the egress policy in force is the latest"): a policy updated while the
// session is suspended (no route to apply it to) is the one the resumed
// runtime's connections meet: a name denied before the suspend is reached
// after the message that resumes it.
func TestEgressPolicyChangedWhileSuspendedAppliesOnResume(t *testing.T) {
	e := startEgressSuite(t)
	sess := e.createSession(t, "egress-susp-"+e.run, "/repo/egress-susp")
	id := sess.GetSessionId()
	curl := []string{"curl", "-sS", "-m", "15", e.url("http", "other.test", e.httpPort)}
	code, out := e.runIn(t, id, "m1", curl...)
	require.Contains(t, out, "denied (not_allowed)", "exit %d", code)

	_, err := e.suspend(t, id, false)
	require.NoError(t, err)
	e.requireSuspended(t, sess)
	up, err := e.ses.UpdateEgressPolicy(context.Background(), &sessionv1.UpdateEgressPolicyRequest{
		SessionId: id, ExpectedVersion: 1, Egress: e.policy(&sessionv1.EgressRule{Host: "other.test", Ports: []uint32{e.httpPort}})})
	require.NoError(t, err, "a suspended session's policy can change")
	require.Equal(t, uint64(2), up.GetVersion())
	e.requireSuspended(t, sess)

	code, out = e.runIn(t, id, "m2", curl...)
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "egress-ok other.test:", "the resumed runtime meets the policy updated while suspended")
}
