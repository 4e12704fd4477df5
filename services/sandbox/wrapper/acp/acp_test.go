package acp

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
	"agentplane.dev/services/sandbox/wrapper/providerrelay"
	"agentplane.dev/services/sandbox/wrapper/runtimedriver"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(envFakeAgent); mode != "" {
		fakeAgent(mode)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// recorder collects what a runtime reports.
type recorder struct {
	mu     sync.Mutex
	frames []runtimejsonl.Frame
	exited chan struct{}
}

func (r *recorder) hooks() runtimedriver.Hooks {
	return runtimedriver.Hooks{
		OnFrame: func(f runtimejsonl.Frame) { r.mu.Lock(); r.frames = append(r.frames, f); r.mu.Unlock() },
		OnExit:  func() { close(r.exited) },
	}
}

func (r *recorder) all() []runtimejsonl.Frame {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.frames)
}

// wait polls until a frame matches (bounded: nothing may hang).
func (r *recorder) wait(t *testing.T, what string, match func(runtimejsonl.Frame) bool) runtimejsonl.Frame {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		for _, f := range r.all() {
			if match(f) {
				return f
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no %s within the bound; frames: %+v", what, r.all())
	return runtimejsonl.Frame{}
}

func (r *recorder) outcomes(session string) []*runtimejsonl.Outcome {
	var out []*runtimejsonl.Outcome
	for _, f := range r.all() {
		if f.Type == runtimejsonl.TypeOutcome && f.SessionID == session {
			out = append(out, f.Outcome)
		}
	}
	return out
}

// startFake runs the test binary as a fake ACP agent in mode.
func startFake(t *testing.T, mode string, initTimeout time.Duration) (*Runtime, *recorder) {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	rec := &recorder{exited: make(chan struct{})}
	rt, err := start(Config{
		Spec: agents.Spec{Profile: "acp", Protocol: agents.ProtocolACP, Command: []string{self}, Env: []string{envFakeAgent + "=" + mode}},
		Home: t.TempDir(), InitTimeout: initTimeout,
	}, "inst-test", rec.hooks())
	require.NoError(t, err)
	t.Cleanup(rt.Stop)
	return rt, rec
}

func open(t *testing.T, rt *Runtime, rec *recorder, session, rsid string) runtimejsonl.Frame {
	t.Helper()
	require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: session, Directory: t.TempDir(), RuntimeSessionID: rsid}))
	return rec.wait(t, "route answer of "+session, func(f runtimejsonl.Frame) bool {
		return f.SessionID == session && (f.Type == runtimejsonl.TypeRouteReady || f.Type == runtimejsonl.TypeRouteFailed)
	})
}

func send(t *testing.T, rt *Runtime, session, id, content string) {
	t.Helper()
	require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeMessage, SessionID: session, MessageID: id, Content: content}))
}

func outcomeOf(t *testing.T, rec *recorder, session, id string) *runtimejsonl.Outcome {
	t.Helper()
	f := rec.wait(t, "outcome of "+id, func(f runtimejsonl.Frame) bool {
		return f.Type == runtimejsonl.TypeOutcome && f.SessionID == session && f.Outcome.LastMessageID == id
	})
	return f.Outcome
}

func TestTurnMapsUpdatesToEvents(t *testing.T) {
	rt, rec := startFake(t, "good", 30*time.Second)
	ready := open(t, rt, rec, "s1", "rs_one")
	require.Equal(t, runtimejsonl.TypeRouteReady, ready.Type)
	require.Equal(t, "rs_one", ready.RuntimeSessionID)

	send(t, rt, "s1", "m1", "hello")
	o := outcomeOf(t, rec, "s1", "m1")
	require.Equal(t, runtimejsonl.ResultSucceeded, o.Result)

	kinds := map[string][]*runtimejsonl.Event{}
	for _, f := range rec.all() {
		if f.Type == runtimejsonl.TypeEvent && f.Event.MessageID == "m1" {
			kinds[f.Event.Kind] = append(kinds[f.Event.Kind], f.Event)
		}
	}
	require.Len(t, kinds[runtimejsonl.KindMessageDelta], 2)
	require.Equal(t, "Hello world", kinds[runtimejsonl.KindMessage][0].Text, "the full message at turn end")
	require.Len(t, kinds[runtimejsonl.KindToolCall], 1)
	require.Equal(t, "write", kinds[runtimejsonl.KindToolCall][0].ToolName)
	require.Equal(t, "edit", kinds[runtimejsonl.KindToolCall][0].Data["tool_kind"])
	res := kinds[runtimejsonl.KindToolResult]
	require.Len(t, res, 1)
	require.Equal(t, "write", res[0].ToolName, "a retitled update keeps the call's name")
	require.Equal(t, "Wrote file", res[0].Text)
	require.Equal(t, map[string]any{"ok": true}, res[0].Data["raw_output"])
	var progress, status []string
	for _, e := range kinds[runtimejsonl.KindProgress] {
		progress = append(progress, e.Data["acp_update"].(string))
	}
	for _, e := range kinds[runtimejsonl.KindStatus] {
		status = append(status, e.Text)
	}
	require.ElementsMatch(t, []string{"agent_thought_chunk", "plan"}, progress)
	require.Subset(t, status, []string{"busy", "usage", "some_future_kind", "idle"}, "unknown kinds are kept as typed status events")
	busy := busyData(t, rec, "s1", "m1")
	require.Equal(t, false, busy["agent_session_loaded"], "a new route: session/new")
	require.InDelta(t, busy["agent_open_ms"], busy["agent_start_ms"].(float64)+busy["agent_session_ms"].(float64), 0.01,
		"the open time splits into start-up and session")

	ids := map[string]bool{}
	for _, f := range rec.all() {
		if f.Type == runtimejsonl.TypeEvent {
			require.False(t, ids[f.Event.EventID], "event ids are unique")
			ids[f.Event.EventID] = true
		}
	}
}

func TestStopReasonsMapToOneOutcome(t *testing.T) {
	rt, rec := startFake(t, "good", 30*time.Second)
	open(t, rt, rec, "s1", "rs_a")
	send(t, rt, "s1", "m1", "refuse please")
	o := outcomeOf(t, rec, "s1", "m1")
	require.Equal(t, runtimejsonl.ResultFailed, o.Result)
	require.Equal(t, "refusal", o.FailureReason)

	send(t, rt, "s1", "m2", "slow one")
	rec.wait(t, "the slow turn's first chunk", func(f runtimejsonl.Frame) bool {
		return f.Type == runtimejsonl.TypeEvent && f.Event.MessageID == "m2" && f.Event.Kind == runtimejsonl.KindMessageDelta
	})
	require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeAbort, SessionID: "s1", MessageID: "m2"}))
	o = outcomeOf(t, rec, "s1", "m2")
	require.Equal(t, runtimejsonl.ResultCancelled, o.Result)
	require.Len(t, rec.outcomes("s1"), 2, "exactly one outcome per turn")
}

func TestPermissionPolicy(t *testing.T) {
	rt, rec := startFake(t, "good", 30*time.Second)
	open(t, rt, rec, "allow", "rs_allow")
	require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: "deny", Directory: t.TempDir(), RuntimeSessionID: "rs_deny", RejectToolKinds: []string{"delete"}}))
	rec.wait(t, "deny ready", func(f runtimejsonl.Frame) bool { return f.SessionID == "deny" && f.Type == runtimejsonl.TypeRouteReady })

	for _, s := range []string{"allow", "deny"} {
		send(t, rt, s, "m1", "perm")
		require.Equal(t, runtimejsonl.ResultSucceeded, outcomeOf(t, rec, s, "m1").Result)
	}
	text := func(s string) (msg, decision string) {
		for _, f := range rec.all() {
			if f.SessionID != s || f.Type != runtimejsonl.TypeEvent {
				continue
			}
			if f.Event.Kind == runtimejsonl.KindMessage {
				msg = f.Event.Text
			}
			if d, ok := f.Event.Data["decision"].(string); ok {
				decision = d
			}
		}
		return msg, decision
	}
	msg, decision := text("allow")
	require.Equal(t, "permission:yes", msg)
	require.Equal(t, "allowed", decision, "the decision is recorded")
	msg, decision = text("deny")
	require.Equal(t, "permission:no", msg)
	require.Equal(t, "rejected", decision)
}

func TestTwoRoutesShareOneAgentAndResumeWithLoad(t *testing.T) {
	home := t.TempDir()
	self, _ := os.Executable()
	spec := agents.Spec{Profile: "acp", Protocol: agents.ProtocolACP, Command: []string{self}, Env: []string{envFakeAgent + "=good"}}
	rec := &recorder{exited: make(chan struct{})}
	rt, err := start(Config{Spec: spec, Home: home, InitTimeout: 30 * time.Second}, "i1", rec.hooks())
	require.NoError(t, err)
	open(t, rt, rec, "s1", "rs_1")
	open(t, rt, rec, "s2", "rs_2")
	send(t, rt, "s1", "m1", "a")
	send(t, rt, "s2", "m1", "b")
	require.Equal(t, runtimejsonl.ResultSucceeded, outcomeOf(t, rec, "s1", "m1").Result)
	require.Equal(t, runtimejsonl.ResultSucceeded, outcomeOf(t, rec, "s2", "m1").Result)
	first := rt.route("s1").acpID
	require.NotEqual(t, first, rt.route("s2").acpID, "each route has its own ACP session")
	rt.Stop()

	// A new agent process (a restarted wrapper) loads the recorded session.
	rec2 := &recorder{exited: make(chan struct{})}
	rt2, err := start(Config{Spec: spec, Home: home, InitTimeout: 30 * time.Second}, "i2", rec2.hooks())
	require.NoError(t, err)
	t.Cleanup(rt2.Stop)
	open(t, rt2, rec2, "s1", "rs_1")
	require.Equal(t, first, rt2.route("s1").acpID, "session/load resumed the same ACP session")
	var steps []string
	for _, f := range rec2.all() {
		if f.Type == runtimejsonl.TypeProgress {
			steps = append(steps, f.Step)
		}
		if f.Event != nil {
			require.NotEqual(t, "old", f.Event.Data["text"], "replayed history is not a new event")
		}
	}
	require.Contains(t, steps, "load_session")
	require.Empty(t, restarts(rec2, "s1"), "a loaded conversation did not restart")
	ready := rec2.wait(t, "route_ready", func(f runtimejsonl.Frame) bool { return f.Type == runtimejsonl.TypeRouteReady })
	require.Equal(t, "rs_1", ready.RuntimeSessionID, "the same runtime session goes on")
	send(t, rt2, "s1", "m2", "again")
	require.Equal(t, runtimejsonl.ResultSucceeded, outcomeOf(t, rec2, "s1", "m2").Result)
	require.Equal(t, true, busyData(t, rec2, "s1", "m2")["agent_session_loaded"], "the first turn after a load says so")
}

// busyData is the data of the busy event that began the turn of message id.
func busyData(t *testing.T, rec *recorder, session, id string) map[string]any {
	t.Helper()
	for _, f := range rec.all() {
		if f.Type == runtimejsonl.TypeEvent && f.SessionID == session && f.Event.MessageID == id && f.Event.Text == "busy" {
			return f.Event.Data
		}
	}
	t.Fatalf("no busy event for %s/%s", session, id)
	return nil
}

// restarts returns the session's conversation_restarted events.
func restarts(rec *recorder, session string) []*runtimejsonl.Event {
	var out []*runtimejsonl.Event
	for _, f := range rec.all() {
		if f.Type == runtimejsonl.TypeEvent && f.SessionID == session && f.Event.Text == ConversationRestarted {
			out = append(out, f.Event)
		}
	}
	return out
}

// An agent that cannot continue the earlier conversation (no loadSession,
// or a session/load that fails) gets a new ACP session under the same
// runtime session, and the session is told once, before the next turn.
func TestRouteThatCannotLoadRestartsTheConversation(t *testing.T) {
	for mode, reason := range map[string]string{"noload": RestartNoLoad, "loadfail": RestartLoadFailed} {
		t.Run(mode, func(t *testing.T) {
			home := t.TempDir()
			self, _ := os.Executable()
			spec := func(mode string) agents.Spec {
				return agents.Spec{Profile: "acp", Protocol: agents.ProtocolACP, Command: []string{self}, Env: []string{envFakeAgent + "=" + mode}}
			}
			rec := &recorder{exited: make(chan struct{})}
			rt, err := start(Config{Spec: spec("good"), Home: home, InitTimeout: 30 * time.Second}, "i1", rec.hooks())
			require.NoError(t, err)
			open(t, rt, rec, "s1", "rs_1")
			send(t, rt, "s1", "m1", "a")
			require.Equal(t, runtimejsonl.ResultSucceeded, outcomeOf(t, rec, "s1", "m1").Result)
			first := rt.route("s1").acpID
			require.Empty(t, restarts(rec, "s1"), "a first conversation is no restart")
			rt.Stop()

			rec2 := &recorder{exited: make(chan struct{})}
			rt2, err := start(Config{Spec: spec(mode), Home: home, InitTimeout: 30 * time.Second}, "i2", rec2.hooks())
			require.NoError(t, err)
			t.Cleanup(rt2.Stop)
			ready := open(t, rt2, rec2, "s1", "rs_1")
			require.Equal(t, runtimejsonl.TypeRouteReady, ready.Type)
			require.Equal(t, "rs_1", ready.RuntimeSessionID)
			second := rt2.route("s1").acpID
			require.NotEqual(t, first, second, "a new ACP session")
			send(t, rt2, "s1", "m2", "b")
			require.Equal(t, runtimejsonl.ResultSucceeded, outcomeOf(t, rec2, "s1", "m2").Result)

			ev := restarts(rec2, "s1")
			require.Len(t, ev, 1)
			require.Equal(t, "rs_1", ev[0].RuntimeSessionID)
			require.Empty(t, ev[0].MessageID, "outside any turn")
			require.Equal(t, runtimejsonl.KindStatus, ev[0].Kind)
			require.Equal(t, map[string]any{"reason": reason, "previous_agent_session_id": first, "agent_session_id": second}, ev[0].Data)
			// Ordered after route_ready and before the next turn's events.
			var order []string
			for _, f := range rec2.all() {
				switch {
				case f.Type == runtimejsonl.TypeRouteReady:
					order = append(order, "ready")
				case f.Type == runtimejsonl.TypeEvent && f.Event.Text == ConversationRestarted:
					order = append(order, "restarted")
				case f.Type == runtimejsonl.TypeEvent && f.Event.MessageID == "m2" && f.Event.Text == "busy":
					order = append(order, "busy")
				}
			}
			require.Equal(t, []string{"ready", "restarted", "busy"}, order)
			require.Equal(t, second, (&sessionStore{file: rt2.store.file}).get("s1"), "the new ACP session is the one to load next")
		})
	}
}

// The faults: each fails its turn (or route) with a named reason, bounded,
// and ends the agent so the route is prepared again.
func TestFaultNonJSONOutputFailsTheTurn(t *testing.T) {
	rt, rec := startFake(t, "garbage", 30*time.Second)
	open(t, rt, rec, "s1", "rs_g")
	send(t, rt, "s1", "m1", "hi")
	o := outcomeOf(t, rec, "s1", "m1")
	require.Equal(t, runtimejsonl.ResultFailed, o.Result)
	require.Equal(t, ReasonProtocol, o.FailureReason)
	waitExit(t, rec)
	requireRouteFailed(t, rec, "s1", ReasonProtocol)
}

func TestFaultNoInitializeAnswerTimesOut(t *testing.T) {
	rt, rec := startFake(t, "silent", 500*time.Millisecond)
	f := open(t, rt, rec, "s1", "rs_s")
	require.Equal(t, runtimejsonl.TypeRouteFailed, f.Type)
	require.Equal(t, ReasonInitTimeout, f.Reason)
	require.True(t, f.Retryable)
	waitExit(t, rec)
}

func TestFaultSecondAnswerIsAProtocolError(t *testing.T) {
	rt, rec := startFake(t, "twice", 30*time.Second)
	open(t, rt, rec, "s1", "rs_t")
	send(t, rt, "s1", "m1", "hi")
	o := outcomeOf(t, rec, "s1", "m1")
	require.Equal(t, runtimejsonl.ResultSucceeded, o.Result, "the first answer settles the turn")
	waitExit(t, rec)
	require.Len(t, rec.outcomes("s1"), 1, "the second answer settles nothing")
	require.Equal(t, ReasonProtocol, rt.brokenReason().reason)
	requireRouteFailed(t, rec, "s1", ReasonProtocol)
}

func TestFaultExitMidTurnFailsTheTurn(t *testing.T) {
	rt, rec := startFake(t, "exit", 30*time.Second)
	open(t, rt, rec, "s1", "rs_e")
	send(t, rt, "s1", "m1", "hi")
	o := outcomeOf(t, rec, "s1", "m1")
	require.Equal(t, runtimejsonl.ResultFailed, o.Result)
	require.Equal(t, ReasonExited, o.FailureReason)
	waitExit(t, rec)
	requireRouteFailed(t, rec, "s1", ReasonExited)
}

// requireRouteFailed: the route failed, retryable, with the agent's own
// reason (reported before the runtime's exit).
func requireRouteFailed(t *testing.T, rec *recorder, session, reason string) {
	t.Helper()
	f := rec.wait(t, "route failure", func(f runtimejsonl.Frame) bool {
		return f.Type == runtimejsonl.TypeRouteFailed && f.SessionID == session
	})
	require.Equal(t, reason, f.Reason)
	require.True(t, f.Retryable)
}

func waitExit(t *testing.T, rec *recorder) {
	t.Helper()
	select {
	case <-rec.exited:
	case <-time.After(60 * time.Second):
		t.Fatal("the runtime did not report its exit")
	}
}

// TestRotationReachesTheNextModelRequest: the agent calls the model at the
// relay its config names; the relay adds the handle current at each
// request, so after a credentials frame the next request carries the new
// handle, from the same agent process. The handle is in no environment,
// argument or config the agent can read.
func TestRotationReachesTheNextModelRequest(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/provider/") { // history posts go to /ingest/
			mu.Lock()
			seen = append(seen, strings.TrimSpace(r.URL.Path+" "+r.Header.Get("Authorization")+" "+r.Header.Get("Traceparent")))
			mu.Unlock()
		}
		_, _ = io.WriteString(w, `{"choices":[]}`)
	}))
	defer up.Close()
	self, err := os.Executable()
	require.NoError(t, err)
	rec := &recorder{exited: make(chan struct{})}
	rt, err := start(Config{
		Spec: agents.Spec{Profile: "acp", Protocol: agents.ProtocolACP, Command: []string{self}, Env: []string{envFakeAgent + "=good"},
			ConfigEnv: "FAKE_CONFIG", ConfigTemplate: `{"baseURL":"{{BASE_URL}}","apiKey":"{{API_KEY}}","model":"{{MODEL}}"}`, Model: "m1"},
		Home: t.TempDir(), InitTimeout: 30 * time.Second,
	}, "inst-rot", rec.hooks())
	require.NoError(t, err)
	t.Cleanup(rt.Stop)
	const oldHandle, newHandle = "aph_old-handle-for-test", "aph_new-handle-for-test"
	require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: "s1", Directory: t.TempDir(),
		RuntimeSessionID: "rs_rot", Handle: oldHandle, ProxyURL: up.URL + "/s/sbx-1"}))
	rec.wait(t, "ready", func(f runtimejsonl.Frame) bool { return f.Type == runtimejsonl.TypeRouteReady })

	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	reply := func(id, traceparent string) []string {
		require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeMessage, SessionID: "s1", MessageID: id, Content: "call the model", Traceparent: traceparent}))
		require.Equal(t, runtimejsonl.ResultSucceeded, outcomeOf(t, rec, "s1", id).Result)
		for _, f := range rec.all() {
			if f.Type == runtimejsonl.TypeEvent && f.Event.MessageID == id && f.Event.Kind == runtimejsonl.KindMessage {
				return strings.Split(f.Event.Text, "|")
			}
		}
		t.Fatal("no reply")
		return nil
	}
	first := reply("m1", "")
	require.Equal(t, "200 OK", first[0])
	require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeCredentials, SessionIDs: []string{"s1"}, Handle: newHandle}))
	second := reply("m2", tp) // the turn's trace context reaches the proxy
	require.Equal(t, first[1], second[1], "the same agent process, not restarted")

	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{
		"/s/sbx-1/provider/v1/chat/completions Bearer " + oldHandle,
		"/s/sbx-1/provider/v1/chat/completions Bearer " + newHandle + " " + tp,
	}, seen)
	for _, part := range append(first[2:], second[2:]...) {
		require.NotContains(t, part, "aph_", "no handle in the agent's config, environment or argv")
	}
	require.Contains(t, first[2], providerrelay.DummyKey, "the config names the relay's dummy key")
}

// Two open_route frames for one session before either is answered (the
// sandbox service sends the route again on a Hello and on a preparation
// that finds the wrapper connected): the agent opens one ACP session, and
// the one recorded for a restarted wrapper's session/load is the one the
// route's turns go to. The recorded one was the losing open's, so a
// restarted wrapper loaded an empty conversation.
func TestRepeatedOpenOpensOneAgentSession(t *testing.T) {
	rt, rec := startFake(t, "good", 30*time.Second)
	for range 2 {
		require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: "s1", Directory: t.TempDir(), RuntimeSessionID: "rs_1"}))
	}
	deadline := time.Now().Add(60 * time.Second)
	for countFrames(rec, "s1", runtimejsonl.TypeRouteReady) < 2 {
		require.True(t, time.Now().Before(deadline), "both opens answered; frames: %+v", rec.all())
		time.Sleep(10 * time.Millisecond)
	}
	served := rt.route("s1").acpID
	require.True(t, strings.HasSuffix(served, "-1"), "one session/new: %s", served)
	require.Equal(t, served, rt.store.get("s1"), "the recorded ACP session is the served one")
}

func countFrames(rec *recorder, session, typ string) int {
	n := 0
	for _, f := range rec.all() {
		if f.SessionID == session && f.Type == typ {
			n++
		}
	}
	return n
}

// TestPreparedSessionServesTheFirstRouteOnly: a pooled agent's session/new
// made right after initialize (PrepareSession) is the first route's at that
// directory, which opens no session of its own; a second route, and a
// route at another directory, each get their own.
func TestPreparedSessionServesTheFirstRouteOnly(t *testing.T) {
	self, err := os.Executable()
	require.NoError(t, err)
	dir := t.TempDir()
	rec := &recorder{exited: make(chan struct{})}
	rt, err := start(Config{
		Spec: agents.Spec{Profile: "acp", Protocol: agents.ProtocolACP, Command: []string{self}, Env: []string{envFakeAgent + "=good"}},
		Home: t.TempDir(), InitTimeout: 30 * time.Second, PrepareSession: dir,
	}, "inst-test", rec.hooks())
	require.NoError(t, err)
	t.Cleanup(rt.Stop)
	<-rt.spareReady
	for i, s := range []string{"s1", "s2"} {
		require.NoError(t, rt.Send(runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: s, Directory: dir, RuntimeSessionID: "rs_" + s}))
		rec.wait(t, "ready "+s, func(f runtimejsonl.Frame) bool { return f.SessionID == s && f.Type == runtimejsonl.TypeRouteReady })
		require.True(t, strings.HasSuffix(rt.route(s).acpID, fmt.Sprintf("-%d", i+1)), "%s: %s", s, rt.route(s).acpID)
	}
	open(t, rt, rec, "s3", "rs_s3")
	require.True(t, strings.HasSuffix(rt.route("s3").acpID, "-3"), "another directory: its own session/new")
	require.Equal(t, rt.route("s1").acpID, rt.store.get("s1"), "the prepared session is recorded as the route's")
}
