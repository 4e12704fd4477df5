package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"agentplane.dev/pkg/logging/logtest"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/credential/attestation"
	credential "agentplane.dev/services/credential/server"
	sandbox "agentplane.dev/services/sandbox/server"
	"agentplane.dev/services/sandbox/wrapper"
)

// wrapperBin is the real agentplane-wrapper binary, built once, as deployed
// (the image's AGENTPLANE_WRAPPER_BIN): the sandbox service launches it as the
// wrapper, which runs its scripted runtime. TestDev covers the all-in-one
// binary in that role.
var wrapperBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "agentplane-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Sandboxes run as their own user (nobody when the tests run as root):
	// the wrapper binary must be reachable.
	if err := os.Chmod(dir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	wrapperBin = filepath.Join(dir, "agentplane-wrapper")
	build := exec.Command("go", slices.Concat([]string{"build"}, wrapper.BuildFlags, []string{"-o", wrapperBin, "agentplane.dev/services/sandbox/cmd/agentplane-wrapper"})...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build agentplane-wrapper:", err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// upstream is a local OpenAI-compatible provider recording what it got.
type upstream struct {
	mu    sync.Mutex
	auth  []string
	attes []string
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.auth = append(u.auth, r.Header.Get("Authorization"))
	u.attes = append(u.attes, r.Header.Get("X-Agentplane-Attestation"))
	u.mu.Unlock()
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"choices":[{"message":{"role":"assistant","content":"upstream says hi"}}]}`)
}

func (u *upstream) seen() ([]string, []string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.auth...), append([]string(nil), u.attes...)
}

// suite is the four real services on ephemeral ports against one private
// redis-server, with every service's log captured.
type suite struct {
	ses     sessionv1.SessionServiceClient
	sesAddr string // the session service's address, for client.Dial
	cred    credentialv1.CredentialServiceClient
	sbx     sandboxv1.SandboxServiceClient
	ing     ingestv1.IngestServiceClient
	up      *upstream
	attKey  []byte
	root    string
	metrics map[string]string // each service's /metrics URL (stackOptions.metrics)
	proxy   string            // http://host:port of the credential proxy
	logs    *logtest.Buffer
	stopped func()
	// run makes the suite's sandbox ids its own: wrappers are found by
	// their sandbox marker in /proc, machine-wide, so two suites (a repeated
	// test, another test binary on the machine) must never share one.
	run string
	// redis is the stack's private Redis (nil on a shared one).
	redis *redis.Client
	// turnBound bounds each turn (0: 90 s); a real agent's cold start wants more.
	turnBound time.Duration
}

// captureStderr sends everything written to os.Stderr (where every
// service's slog handler writes) to a buffer until the test ends.
func captureStderr(t testing.TB) *logtest.Buffer {
	buf := &logtest.Buffer{}
	r, w, err := os.Pipe()
	require.NoError(t, err)
	orig := os.Stderr
	os.Stderr = w
	done := make(chan struct{})
	go func() { _, _ = io.Copy(buf, r); close(done) }()
	t.Cleanup(func() {
		os.Stderr = orig
		_ = w.Close()
		<-done
		_ = r.Close()
	})
	return buf
}

func startSuite(t testing.TB) *suite { return startSuiteWith(t, nil, nil) }

// startSuiteIsolated starts the suite with SANDBOX_ISOLATION=isolation.
func startSuiteIsolated(t testing.TB, isolation string) *suite {
	return startSuiteWith(t, nil, func(c *sandbox.Config) { c.Isolation = isolation })
}

// startSuiteWith is startSuite with another provider upstream (nil: the
// recording upstream) and a hook that adjusts the sandbox configuration.
func startSuiteWith(t testing.TB, up http.Handler, tune func(*sandbox.Config)) *suite {
	return startSuiteAt(t, up, tune, store{})
}

// store is the Redis a suite's services use: URL "" starts a private
// redis-server; MinReplicas is every service's AGENTPLANE_REDIS_MIN_REPLICAS.
type store struct {
	URL         string
	MinReplicas int
}

// startSuiteAt is startSuiteWith on the Redis st names.
func startSuiteAt(t testing.TB, up http.Handler, tune func(*sandbox.Config), st store) *suite {
	return startSuiteTuned(t, stackOptions{upstream: up, redisURL: st.URL, minReplicas: st.MinReplicas}, tune, nil)
}

// startSuiteTuned is the suite on the stack o describes, with hooks that
// adjust the sandbox and credential configurations.
func startSuiteTuned(t testing.TB, o stackOptions, tune func(*sandbox.Config), tuneCred func(*credential.Config)) *suite {
	st := newStack(t, o)
	logs := captureStderr(t)
	stopped := st.runInProcess(func(c *configs) {
		if tune != nil {
			tune(&c.sbx)
		}
		if tuneCred != nil {
			tuneCred(&c.cred)
		}
	})
	s := st.suite()
	s.logs, s.stopped = logs, stopped
	return s
}

// create makes a session with a static credential, retrying while the
// services come up. The sandbox id is sandboxID made unique to the suite
// (the session's SandboxId tells it).
func (s *suite) create(t testing.TB, sandboxID, dir, secret string) *sessionv1.Session {
	var out *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: sandboxID + "-" + s.run,
			Worktree:   &sessionv1.Worktree{Directory: dir},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: secret},
		})
		out = resp.GetSession()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	return out
}

// turn sends one message and watches the session until its outcome; it
// returns every event seen.
func (s *suite) turn(t testing.TB, sessionID, messageID, content string) []*sessionv1.SessionEvent {
	bound := 90 * time.Second
	if s.turnBound > 0 {
		bound = s.turnBound
	}
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	// UNAVAILABLE is retried with the same id, as clients do (e.g. a Redis failover).
	_, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sessionID, MessageId: messageID, Content: content})
	for status.Code(err) == codes.Unavailable && ctx.Err() == nil {
		time.Sleep(100 * time.Millisecond)
		_, err = s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sessionID, MessageId: messageID, Content: content})
	}
	require.NoError(t, err)
	stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sessionID})
	require.NoError(t, err)
	var events []*sessionv1.SessionEvent
	own := false // the watch replays the log: a route failure before this message is an earlier one's
	for {
		resp, err := stream.Recv()
		require.NoError(t, err, "watch ended before the outcome; events so far: %v", events)
		ev := resp.GetEvent()
		events = append(events, ev)
		own = own || ev.GetMessage().GetMessageId() == messageID
		if o := ev.GetOutcome(); o != nil && o.GetLastMessageId() == messageID {
			require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
			return events
		}
		if r := ev.GetRoute(); own && r != nil && r.GetState() == sessionv1.RouteState_ROUTE_STATE_FAILED {
			t.Fatalf("route failed: %s", r.GetFailureReason())
		}
		// A message failed without an outcome (its runtime was stopped under it) has none to wait for.
		if msg := ev.GetMessage(); msg.GetMessageId() == messageID && msg.GetState() == sessionv1.MessageState_MESSAGE_STATE_FAILED {
			t.Fatalf("message %s failed: %s", messageID, msg.GetFailureReason())
		}
	}
}

func (s *suite) routeView(t *testing.T, sessionID string) *sessionv1.RouteView {
	resp, err := s.ses.GetSession(context.Background(), &sessionv1.GetSessionRequest{SessionId: sessionID})
	require.NoError(t, err)
	return resp.GetSession().GetRoute()
}

func newRunID() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func newSecret() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return "sk-e2e-" + hex.EncodeToString(b)
}

// TestRuntimeCallsProviderThroughProxy (issue 9): a scripted runtime in a
// prepared route calls the provider route through the proxy with the handle
// it was delivered; the upstream sees the session's backing secret and a
// verifiable attestation; the secret is in no file under the sandbox root,
// no process environment or command line, and no service log line.
func TestRuntimeCallsProviderThroughProxy(t *testing.T) {
	s := startSuite(t)
	secret := newSecret()
	sess := s.create(t, "sbx-prov", "/work/e2e-repo", secret)

	events := s.turn(t, sess.GetSessionId(), "m1", "hello provider")
	var provider map[string]any
	for _, ev := range events {
		if re := ev.GetRuntimeEvent(); re != nil && re.GetToolName() == "provider" && re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT {
			provider = re.GetData().AsMap()
		}
	}
	require.NotNil(t, provider, "the runtime reported its provider call")
	require.EqualValues(t, 200, provider["status"])
	require.Equal(t, "upstream says hi", provider["reply"])

	auth, attes := s.up.seen()
	require.NotEmpty(t, auth)
	require.Equal(t, "Bearer "+secret, auth[0], "the upstream gets the backing secret")
	claims, err := attestation.Verify(s.attKey, attes[0], time.Now())
	require.NoError(t, err)
	require.Equal(t, "u-e2e", claims.UserID)
	require.Equal(t, sess.GetSandboxId(), claims.SandboxID)
	require.Equal(t, sess.GetSessionId(), claims.SessionID)
	require.Equal(t, s.routeView(t, sess.GetSessionId()).GetRuntimeSessionId(), claims.RuntimeSessionID)

	// While the wrapper and runtime still run: no process shows the secret.
	procs := scanProcs(t, secret)
	require.Positive(t, procs, "scanned live processes")
	scanFiles(t, s.root, secret)
	s.stopped()
	require.NotContains(t, s.logs.String(), secret, "no service log line holds the secret")
	require.Contains(t, s.logs.String(), `"service":"sandbox"`, "the sandbox's log was captured")
	// The wrapper was still connected when the services stopped: the
	// sandbox's graceful stop ended its stream instead of waiting for the
	// hard-stop bound.
	require.NotContains(t, s.logs.String(), `"step":"hard_stop"`, "every service drained without a hard stop")
}

// scanProcs reads the environ and cmdline of every process it may read
// and fails if one contains needle; it returns how many it read.
func scanProcs(t *testing.T, needle string) int {
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	n := 0
	for _, e := range entries {
		if strings.Trim(e.Name(), "0123456789") != "" {
			continue
		}
		for _, f := range []string{"environ", "cmdline"} {
			b, err := os.ReadFile(filepath.Join("/proc", e.Name(), f))
			if err != nil {
				continue // gone, or another user's
			}
			n++
			require.NotContains(t, string(b), needle, "/proc/%s/%s", e.Name(), f)
		}
	}
	return n
}

func scanFiles(t *testing.T, root, needle string) {
	files := 0
	require.NoError(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		files++
		require.NotContains(t, string(b), needle, p)
		return nil
	}))
	require.Positive(t, files, "the sandbox root holds files (logs, workspace records)")
}

// TestRuntimeHistoryReachesIngest (issue 7): the scripted runtime posts its
// history through the proxy's ingest route with its handle, under the
// runtime session id the route reports, and Export returns it.
func TestRuntimeHistoryReachesIngest(t *testing.T) {
	s := startSuite(t)
	sess := s.create(t, "sbx-hist", "/work/e2e-hist", newSecret())
	s.turn(t, sess.GetSessionId(), "m1", "remember this")
	rsid := s.routeView(t, sess.GetSessionId()).GetRuntimeSessionId()
	require.NotEmpty(t, rsid)

	var items []*ingestv1.Item
	require.Eventually(t, func() bool {
		resp, err := s.ing.Export(context.Background(), &ingestv1.ExportRequest{RuntimeSessionId: rsid,
			Scope: &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V1{V1: &ingestv1.ScopeV1{RuntimeSessionId: rsid}}}})
		items = resp.GetItems()
		return err == nil && len(items) >= 5
	}, 30*time.Second, 50*time.Millisecond)
	byID := map[string]*ingestv1.Item{}
	for _, it := range items {
		byID[it.GetItemId()] = it
	}
	require.Equal(t, ingestv1.ItemType_ITEM_TYPE_SESSION, byID["session"].GetType())
	require.Equal(t, ingestv1.ItemType_ITEM_TYPE_STATUS, byID["status"].GetType())
	require.Equal(t, ingestv1.ItemType_ITEM_TYPE_PART, byID["reply-m1-part-0"].GetType())
	var user, reply struct{ Role, Text string }
	require.NoError(t, json.Unmarshal(byID["msg-m1"].GetPayload(), &user))
	require.NoError(t, json.Unmarshal(byID["reply-m1"].GetPayload(), &reply))
	require.Equal(t, "remember this", user.Text)
	require.Equal(t, "Scripted reply to: remember this", reply.Text)
}

// TestSiblingAdoptsWorktreeHandle: two sessions in one worktree directory
// of one sandbox share the runtime, and the second adopts the first's
// canonical handle (same grant digest, both members).
func TestSiblingAdoptsWorktreeHandle(t *testing.T) {
	s := startSuite(t)
	first := s.create(t, "sbx-shared", "/work/e2e-shared", newSecret())
	second := s.create(t, "sbx-shared", "/work/e2e-shared", newSecret())
	s.turn(t, first.GetSessionId(), "m1", "first")
	s.turn(t, second.GetSessionId(), "m1", "second")

	v1, v2 := s.routeView(t, first.GetSessionId()), s.routeView(t, second.GetSessionId())
	require.NotEqual(t, v1.GetRuntimeSessionId(), v2.GetRuntimeSessionId())
	require.Equal(t, v1.GetWrapperInstance(), v2.GetWrapperInstance(), "one runtime serves the directory")

	// Both runtime sessions are live member roots of one scope whose grant
	// is the single canonical worktree handle.
	sc := &credentialv1.Scope{SandboxId: first.GetSandboxId(), Directory: "/work/e2e-shared"}
	for _, v := range []*sessionv1.RouteView{v1, v2} {
		resp, err := s.cred.CheckScopeMember(context.Background(), &credentialv1.CheckScopeMemberRequest{Scope: sc, RuntimeSessionId: v.GetRuntimeSessionId()})
		require.NoError(t, err)
		require.True(t, resp.GetLive())
	}
	// The upstream saw each session's own backing secret? No: the canonical
	// handle resolves through its issuer while it is a member, so both turns
	// used the first session's credential — one grant, one digest.
	_, attes := s.up.seen()
	require.Len(t, attes, 2)
	digests := map[string]bool{}
	for _, a := range attes {
		c, err := attestation.Verify(s.attKey, a, time.Now())
		require.NoError(t, err)
		require.Equal(t, "worktree", strings.ToLower(c.HandleKind))
		require.Equal(t, first.GetSessionId(), c.SessionID, "resolved through the issuer")
		digests[c.SecretDigest] = true
	}
	require.Len(t, digests, 1)
}
