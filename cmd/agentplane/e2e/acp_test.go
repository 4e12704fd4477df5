package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/apierr/apierrtest"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/testenv"
	credential "agentplane.dev/services/credential/server"
	sandbox "agentplane.dev/services/sandbox/server"
)

// agentsDir is where `make agents` installs the pinned agents (the repo's
// agents/), or AGENTPLANE_AGENTS_DIR. When its node_modules is a link (a
// worktree sharing another checkout's), it is the directory the link leads
// to: a sandbox binds the agents directory alone and could not follow it.
func agentsDir(t testing.TB) string {
	d := os.Getenv("AGENTPLANE_AGENTS_DIR")
	if d == "" {
		var err error
		d, err = filepath.Abs(filepath.Join("..", "..", "..", "agents"))
		require.NoError(t, err)
	}
	if fi, err := os.Lstat(filepath.Join(d, "node_modules")); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		modules, err := filepath.EvalSymlinks(filepath.Join(d, "node_modules"))
		require.NoError(t, err)
		if filepath.Base(modules) == "node_modules" {
			return filepath.Dir(modules)
		}
	}
	return d
}

// requireAgent returns the agents directory when the pinned agent's program
// is installed. Under CI=true a missing agent fails the test; locally the
// test is skipped and says why.
func requireAgent(t testing.TB, name string) string {
	dir := agentsDir(t)
	bin := map[string]string{"opencode": filepath.Join(dir, "node_modules", "opencode-linux-x64", "bin", "opencode"),
		"kilo": filepath.Join(dir, "node_modules", "@kilocode", "cli-linux-x64", "bin", "kilo")}[name]
	if _, err := os.Stat(bin); err != nil {
		testenv.Missing(t, "pinned agent %s is not installed at %s (make agents): %v", name, bin, err)
	}
	return dir
}

type acpSuite struct {
	*suite
	model *fakemodel.Server
}

// startACPSuite runs the four services with the fake model as the proxy's
// provider upstream and the pinned agents installed as profiles.
func startACPSuite(t *testing.T, agent string, tune func(*sandbox.Config)) *acpSuite {
	return startACPSuiteTuned(t, agent, tune, nil)
}

// startACPSuiteTuned is startACPSuite that also tunes the credential service.
func startACPSuiteTuned(t *testing.T, agent string, tune func(*sandbox.Config), tuneCred func(*credential.Config)) *acpSuite {
	dir := requireAgent(t, agent)
	model := fakemodel.New()
	s := startSuiteTuned(t, stackOptions{upstream: model, metrics: true}, func(c *sandbox.Config) {
		c.AgentsDir, c.AgentModel = dir, "fake-model"
		if tune != nil {
			tune(c)
		}
	}, tuneCred)
	return &acpSuite{suite: s, model: model}
}

func (s *suite) createAgent(t testing.TB, sandboxID, dir, secret, profile string) *sessionv1.Session {
	var out *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: sandboxID + "-" + s.run,
			Worktree:   &sessionv1.Worktree{Directory: dir},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: secret},
			Agent:      &sessionv1.Agent{Profile: profile},
		})
		out = resp.GetSession()
		return err == nil
	}, 60*time.Second, 100*time.Millisecond)
	return out
}

// watchTurn sends a message and watches until its outcome (any result);
// a failed route ends the test.
func (s *acpSuite) watchTurn(t *testing.T, sessionID, messageID, content string, during func(ev *sessionv1.SessionEvent)) ([]*sessionv1.SessionEvent, *runtimev1.TurnOutcome) {
	var outcome *runtimev1.TurnOutcome
	events := s.watchUntil(t, sessionID, messageID, content, func(ev *sessionv1.SessionEvent) bool {
		if during != nil {
			during(ev)
		}
		if r := ev.GetRoute(); r != nil && r.GetState() == sessionv1.RouteState_ROUTE_STATE_FAILED {
			t.Fatalf("route failed: %s", r.GetFailureReason())
		}
		if o := ev.GetOutcome(); o != nil && o.GetLastMessageId() == messageID {
			outcome = o
		}
		return outcome != nil
	})
	return events, outcome
}

// watchUntil sends a message and watches the session until done says so;
// agents start slowly here, so the bound is generous (but nothing may
// hang). It returns every event seen.
func (s *acpSuite) watchUntil(t *testing.T, sessionID, messageID, content string, done func(ev *sessionv1.SessionEvent) bool) []*sessionv1.SessionEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sessionID})
	require.NoError(t, err)
	_, err = s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sessionID, MessageId: messageID, Content: content})
	require.NoError(t, err)
	var seen []*sessionv1.SessionEvent
	for {
		resp, err := stream.Recv()
		require.NoError(t, err, "watch ended before the end; events so far: %v", seen)
		seen = append(seen, resp.GetEvent())
		if done(resp.GetEvent()) {
			return seen
		}
	}
}

func runtimeEvents(events []*sessionv1.SessionEvent, messageID string) map[runtimev1.RuntimeEventKind][]*runtimev1.RuntimeEvent {
	out := map[runtimev1.RuntimeEventKind][]*runtimev1.RuntimeEvent{}
	for _, ev := range events {
		if re := ev.GetRuntimeEvent(); re != nil && re.GetMessageId() == messageID {
			out[re.GetKind()] = append(out[re.GetKind()], re)
		}
	}
	return out
}

func outcomesOf(events []*sessionv1.SessionEvent, messageID string) int {
	n := 0
	for _, ev := range events {
		if o := ev.GetOutcome(); o != nil && o.GetLastMessageId() == messageID {
			n++
		}
	}
	return n
}

// findFile returns the paths named name under root.
func findFile(t testing.TB, root, name string) []string {
	var out []string
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == name {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// TestAgentCreatesAFile (issue 17): each real pinned agent, driven over
// ACP by the wrapper, writes hello.txt in the session's workspace with its own
// tool; the session's watchers see the deltas, the tool call and its result
// and one succeeded outcome; the model saw the backing secret, never a
// handle; Export returns the conversation.
func TestAgentCreatesAFile(t *testing.T) {
	forEachAgent(t, testAgentCreatesAFile)
}

func testAgentCreatesAFile(t *testing.T, agent string) {
	s := startACPSuite(t, agent, nil)
	secret := newSecret()
	sess := s.createAgent(t, "sbx-"+agent, "/work/e2e-"+agent, secret, agent)
	require.Equal(t, agent, sess.GetAgent().GetProfile(), "the session reports its agent")
	require.Equal(t, "fake-model", sess.GetAgent().GetModel())

	events, o := s.watchTurn(t, sess.GetSessionId(), "m1", "Please create hello.txt", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
	require.Equal(t, 1, outcomesOf(events, "m1"), "exactly one outcome")
	byKind := runtimeEvents(events, "m1")
	require.NotEmpty(t, byKind[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA], "message deltas")
	calls := byKind[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL]
	require.NotEmpty(t, calls, "the tool call")
	require.Equal(t, fakemodel.WriteTool, calls[0].GetToolName())
	results := byKind[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT]
	require.NotEmpty(t, results, "the tool result")
	require.Equal(t, "completed", results[0].GetData().AsMap()["status"])
	msgs := byKind[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE]
	require.NotEmpty(t, msgs)
	require.Contains(t, msgs[len(msgs)-1].GetText(), fakemodel.ToolDone)

	files := findFile(t, s.root, "hello.txt")
	require.Len(t, files, 1, "the agent wrote one hello.txt under the sandbox root")
	require.Contains(t, files[0], string(filepath.Separator)+"workspaces"+string(filepath.Separator), "in the session's workspace")
	b, err := os.ReadFile(files[0])
	require.NoError(t, err)
	require.Equal(t, fakemodel.FileContent, string(b))

	reqs := s.model.Requests()
	require.NotEmpty(t, reqs)
	for _, r := range reqs {
		require.Equal(t, "Bearer "+secret, r.Authorization, "the model sees the backing secret")
		require.NotContains(t, r.Authorization, "aph_")
		require.NotContains(t, r.Authorization, "aps_")
	}

	view := s.routeView(t, sess.GetSessionId())
	require.Equal(t, agent, view.GetAgent().GetProfile(), "the route reports the agent it runs")
	require.Equal(t, "fake-model", view.GetAgent().GetModel())
	rsid := view.GetRuntimeSessionId()
	require.NotEmpty(t, rsid)
	var items []*ingestv1.Item
	require.Eventually(t, func() bool {
		resp, err := s.ing.Export(context.Background(), &ingestv1.ExportRequest{RuntimeSessionId: rsid,
			Scope: &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V1{V1: &ingestv1.ScopeV1{RuntimeSessionId: rsid}}}})
		items = resp.GetItems()
		return err == nil && len(items) >= 5
	}, 60*time.Second, 100*time.Millisecond)
	byID := map[string]map[string]any{}
	for _, it := range items {
		var p map[string]any
		require.NoError(t, json.Unmarshal(it.GetPayload(), &p))
		byID[it.GetItemId()] = p
	}
	require.Equal(t, "Please create hello.txt", byID["msg-m1"]["text"], "the user message")
	require.Contains(t, byID["reply-m1"]["text"], fakemodel.ToolDone, "the assistant reply")
	var tool map[string]any
	for id, p := range byID {
		if strings.HasPrefix(id, "reply-m1-tool-") {
			tool = p
		}
	}
	require.NotNil(t, tool, "the tool call is in the history: %v", byID)
	require.Equal(t, "tool_call", tool["kind"])
	require.Equal(t, "edit", tool["tool_kind"])

	// The handle is nowhere the agent can see it: no process environment or
	// command line, no file under the sandbox root (home, configs, the
	// agent's own data).
	require.Positive(t, scanProcs(t, "aph_"))
	scanFiles(t, s.root, "aph_")
	scanFiles(t, s.root, secret)
}

// TestAgentAbortAndSharedWorktree: an abort mid-turn ends the turn with
// one cancelled outcome; a second session in the same worktree joins the
// same agent process with its own ACP session.
func TestAgentAbortAndSharedWorktree(t *testing.T) {
	forEachAgent(t, testAgentAbortAndSharedWorktree)
}

func testAgentAbortAndSharedWorktree(t *testing.T, agent string) {
	s := startACPSuite(t, agent, nil)
	first := s.createAgent(t, "sbx-abort-"+agent, "/work/e2e-shared", newSecret(), agent)
	second := s.createAgent(t, "sbx-abort-"+agent, "/work/e2e-shared", newSecret(), agent)

	cancelled := false
	events, o := s.watchTurn(t, first.GetSessionId(), "m1", "think slow about it", func(ev *sessionv1.SessionEvent) {
		if re := ev.GetRuntimeEvent(); !cancelled && re != nil && re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA {
			cancelled = true
			_, err := s.ses.CancelMessage(context.Background(), &sessionv1.CancelMessageRequest{SessionId: first.GetSessionId(), MessageId: "m1"})
			require.NoError(t, err)
		}
	})
	require.True(t, cancelled, "the turn streamed before it was aborted")
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_CANCELLED, o.GetResult(), "outcome %v", o)
	require.Equal(t, 1, outcomesOf(events, "m1"), "exactly one outcome")

	_, o2 := s.watchTurn(t, second.GetSessionId(), "m1", "hello", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o2.GetResult())

	v1, v2 := s.routeView(t, first.GetSessionId()), s.routeView(t, second.GetSessionId())
	require.Equal(t, v1.GetWrapperInstance(), v2.GetWrapperInstance(), "one wrapper serves the worktree")
	require.NotEqual(t, v1.GetRuntimeSessionId(), v2.GetRuntimeSessionId())
	agents := agentProcesses(t, v1.GetWrapperInstance())
	require.Len(t, agents, 1, "one agent process for the worktree")

	// Each route has its own ACP session, recorded under the sandbox home.
	maps := findFile(t, s.root, "acp-sessions.json")
	require.Len(t, maps, 1)
	var m map[string]string
	b, err := os.ReadFile(maps[0])
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &m))
	require.NotEmpty(t, m[first.GetSessionId()])
	require.NotEmpty(t, m[second.GetSessionId()])
	require.NotEqual(t, m[first.GetSessionId()], m[second.GetSessionId()])
}

// agentProcesses lists the pids of agent runtimes a wrapper instance started
// (AGENTPLANE_RUNTIME_PARENT): the agent itself, the topmost process of its
// tree that is not bubblewrap. Since c2e4a5e the wrapper runs each agent in a
// nested bubblewrap whose processes carry the agent's environment and lead
// process groups, so neither the environment nor group leadership alone
// tells the agent; its own children (language servers, tools) have the agent
// as parent and are left out.
func agentProcesses(t *testing.T, instance string) []int {
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	type node struct {
		ppid  int
		bwrap bool
	}
	tree := map[int]node{}
	for _, e := range entries {
		if strings.Trim(e.Name(), "0123456789") != "" {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil || !slices.Contains(strings.Split(string(env), "\x00"), "AGENTPLANE_RUNTIME_PARENT="+instance) {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil || strings.Contains(string(stat), ") Z ") {
			continue
		}
		pid, ppid, ok := statParent(string(stat))
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if !ok || err != nil {
			continue
		}
		argv0, _, _ := strings.Cut(string(cmdline), "\x00")
		tree[pid] = node{ppid: ppid, bwrap: filepath.Base(argv0) == "bwrap"}
	}
	var pids []int
	for pid, n := range tree {
		if parent, inTree := tree[n.ppid]; !n.bwrap && (!inTree || parent.bwrap) {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	return pids
}

// statParent reads the pid and the parent pid from /proc/<pid>/stat.
func statParent(stat string) (pid, ppid int, ok bool) {
	open, end := strings.IndexByte(stat, '('), strings.LastIndexByte(stat, ')')
	if open < 0 || end < open {
		return 0, 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(stat[:open]))
	fields := strings.Fields(stat[end+1:])
	if err != nil || len(fields) < 2 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(fields[1])
	return pid, ppid, err == nil
}

// TestAgentResumesAfterWrapperKill: kill -9 of the wrapper takes its
// agent along; the route is prepared again on a new wrapper, which resumes
// the same ACP session with session/load, so the conversation goes on.
func TestAgentResumesAfterWrapperKill(t *testing.T) {
	forEachAgent(t, testAgentResumesAfterWrapperKill)
}

func testAgentResumesAfterWrapperKill(t *testing.T, agent string) {
	s := startACPSuite(t, agent, func(c *sandbox.Config) {
		// Notice the dead wrapper soon.
		c.Timers.Heartbeat, c.Timers.DeadAfter, c.Timers.ReconnectWindow = 200*time.Millisecond, time.Second, 2*time.Second
	})
	sess := s.createAgent(t, "sbx-kill-"+agent, "/work/e2e-kill", newSecret(), agent)
	_, o := s.watchTurn(t, sess.GetSessionId(), "m1", "hello kumquat", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult())
	// A kill -9 loses what the agent has not written yet: the turn's outcome
	// can come before the agent stores the turn (a loaded machine showed it),
	// and a conversation the agent never stored cannot be loaded.
	agentStored(t, s.root, "kumquat")
	t.Cleanup(func() {
		if t.Failed() {
			logHomes(t, s.root, "kumquat")
		}
	})
	before := s.routeView(t, sess.GetSessionId())
	maps := findFile(t, s.root, "acp-sessions.json")
	require.Len(t, maps, 1)
	acpBefore := readSessionMap(t, maps[0])[sess.GetSessionId()]
	require.NotEmpty(t, acpBefore)

	wrapperPID := wrapperProcess(t, before.GetWrapperInstance())
	require.NoError(t, syscall.Kill(wrapperPID, syscall.SIGKILL))

	// The next message re-prepares the route on a new wrapper.
	var o2 *runtimev1.TurnOutcome
	require.Eventually(t, func() bool {
		v := s.routeView(t, sess.GetSessionId())
		return v.GetState() != sessionv1.RouteState_ROUTE_STATE_READY || v.GetWrapperInstance() != before.GetWrapperInstance()
	}, 2*time.Minute, 100*time.Millisecond, "the session noticed the dead wrapper")
	_, o2 = s.watchTurn(t, sess.GetSessionId(), "m2", "hello again", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o2.GetResult())
	after := s.routeView(t, sess.GetSessionId())
	require.NotEqual(t, before.GetWrapperInstance(), after.GetWrapperInstance(), "a new wrapper serves the route")
	require.Equal(t, before.GetRuntimeSessionId(), after.GetRuntimeSessionId(), "the same runtime session goes on")
	require.Equal(t, acpBefore, readSessionMap(t, maps[0])[sess.GetSessionId()], "the same ACP session, loaded")

	// The model got the earlier turn's messages again: the conversation
	// continued rather than starting over.
	last := turnRequest(t, s.model.Requests(), "hello again")
	if last.Messages <= 2 {
		for i, r := range s.model.Requests() {
			t.Logf("model request %d: %d messages, %d tools, last %q", i, r.Messages, len(r.Tools), r.LastText)
		}
	}
	require.Greater(t, last.Messages, 2, "the resumed conversation carries the first turn")
}

// logHomes logs every file of the agents' homes under root, with its size
// and whether it holds text.
func logHomes(t *testing.T, root, text string) {
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.Contains(p, "/homes/") {
			return nil
		}
		b, _ := os.ReadFile(p)
		t.Logf("home file %s: %d bytes, holds %q: %v", p, len(b), text, bytes.Contains(b, []byte(text)))
		return nil
	})
}

// agentStored waits until a file of an agent's home under root holds text
// and the agent has stopped writing its home (no file of it changed size or
// time for a second): the agent wrote the turn to its own store and
// finished what it does after a turn. Both pinned agents keep their
// conversations in SQLite, whose write-ahead log has a prompt's text as soon
// as it is stored; a loaded run showed kilo's outcome arrive before the
// prompt was stored, and the prompt stored before the turn was complete.
func agentStored(t *testing.T, root, text string) {
	t.Helper()
	var last map[string]string
	require.Eventually(t, func() bool {
		found := false
		now := map[string]string{}
		_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.Contains(p, "/homes/") {
				return nil
			}
			if fi, err := d.Info(); err == nil {
				now[p] = fmt.Sprint(fi.Size(), fi.ModTime().UnixNano())
			}
			if !found {
				b, err := os.ReadFile(p)
				found = err == nil && bytes.Contains(b, []byte(text))
			}
			return nil
		})
		quiet := maps.Equal(now, last)
		last = now
		return found && quiet
	}, 2*time.Minute, time.Second, "the agent never stored %q and went quiet", text)
}

// turnRequest is the last model request of the turn whose user message
// holds text: one offering tools (agents also make requests of their own,
// such as kilo's title, and may wrap the user's text).
func turnRequest(t *testing.T, reqs []fakemodel.Request, text string) fakemodel.Request {
	for i := len(reqs) - 1; i >= 0; i-- {
		if strings.Contains(reqs[i].LastText, text) && len(reqs[i].Tools) > 0 {
			return reqs[i]
		}
	}
	var seen []string
	for _, r := range reqs {
		seen = append(seen, fmt.Sprintf("%s(%d tools): %.80q", r.LastRole, len(r.Tools), r.LastText))
	}
	t.Fatalf("no model request of the turn %q; requests: %v", text, seen)
	return fakemodel.Request{}
}

func readSessionMap(t *testing.T, file string) map[string]string {
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	var m map[string]string
	require.NoError(t, json.Unmarshal(b, &m))
	return m
}

// wrapperProcess finds the wrapper process by its instance marker.
func wrapperProcess(t *testing.T, instance string) int {
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	for _, e := range entries {
		if strings.Trim(e.Name(), "0123456789") != "" {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err == nil && slices.Contains(strings.Split(string(env), "\x00"), "AGENTPLANE_INSTANCE="+instance) {
			pid, _ := strconv.Atoi(e.Name())
			return pid
		}
	}
	t.Fatalf("no wrapper with instance %s", instance)
	return 0
}

// TestAgentProfileChecks: an unknown profile, or one that is not installed,
// is refused at CreateSession with AGENT_UNAVAILABLE and a field violation;
// a session that asks for another agent than the one its worktree runs is
// refused at CreateSession with AGENT_MISMATCH, and the first session goes on.
func TestAgentProfileChecks(t *testing.T) {
	s := startACPSuite(t, "opencode", func(c *sandbox.Config) {
		c.AgentACP = filepath.Join(t.TempDir(), "no-such-agent") // configured, not installed
	})
	for _, profile := range []string{"nope", "acp"} {
		var err error
		require.Eventually(t, func() bool { // the services may still be starting
			_, err = s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
				UserId: "u-e2e", OrgId: "o-e2e", SandboxId: "sbx-prof-" + s.run, Worktree: &sessionv1.Worktree{Directory: "/work/e2e-prof"},
				Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
				Agent:      &sessionv1.Agent{Profile: profile},
			})
			return status.Code(err) != codes.Unavailable
		}, 60*time.Second, 100*time.Millisecond)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "profile %s: %v", profile, err)
		require.Equal(t, "AGENT_UNAVAILABLE", apierr.Reason(err))
		fv := apierr.FieldViolations(err)
		require.Len(t, fv, 1)
		require.Equal(t, "agent.profile", fv[0].GetField())
	}

	scripted := s.createAgent(t, "sbx-mix", "/work/e2e-mix", newSecret(), "scripted")
	_, o := s.watchTurn(t, scripted.GetSessionId(), "m1", "hello", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult())
	// Issue 32: the directory runs the scripted agent; a session asking for
	// another is refused at CreateSession, not at its first message.
	_, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
		UserId: "u-e2e", OrgId: "o-e2e", SandboxId: scripted.GetSandboxId(), Worktree: &sessionv1.Worktree{Directory: "/work/e2e-mix"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
		Agent:      &sessionv1.Agent{Profile: "opencode"},
	})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "AGENT_MISMATCH")
	_, o = s.watchTurn(t, scripted.GetSessionId(), "m2", "still here", nil)
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "the worktree's own session is not affected")
}

// TestAgentHandleRotation: a handle rotated during a session reaches the
// live wrapper (SandboxService.RotateHandle pushes it on the control
// stream), whose provider relay puts it on the agent's next model request:
// with no overlap window the old handle stops resolving at once, so the
// next turn only reaches the model, with the backing secret, through the
// new one. The agent process and the wrapper are the same before and after.
func TestAgentHandleRotation(t *testing.T) {
	forEachAgent(t, func(t *testing.T, agent string) {
		s := startACPSuiteTuned(t, agent, nil, func(c *credential.Config) { c.OverlapWindow = 0 })
		secret := newSecret()
		sess := s.createAgent(t, "sbx-rot-"+agent, "/work/e2e-rot", secret, agent)
		_, o := s.watchTurn(t, sess.GetSessionId(), "m1", "hello", nil)
		require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
		before := s.routeView(t, sess.GetSessionId())
		pids := agentProcesses(t, before.GetWrapperInstance())
		require.Len(t, pids, 1)
		seen := len(s.model.Requests())

		rot, err := s.sbx.RotateHandle(context.Background(), &sandboxv1.RotateHandleRequest{SessionId: sess.GetSessionId(), SandboxId: sess.GetSandboxId(), Tenant: e2eTenant})
		require.NoError(t, err)
		require.Equal(t, []string{sess.GetSessionId()}, rot.GetSessionIds())

		_, o = s.watchTurn(t, sess.GetSessionId(), "m2", "hello again", nil)
		require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
		reqs := s.model.Requests()[seen:]
		require.NotEmpty(t, reqs, "the next turn reached the model through the rotated handle")
		for _, r := range reqs {
			require.Equal(t, "Bearer "+secret, r.Authorization, "the proxy resolved the new handle to the backing secret")
		}
		turnRequest(t, reqs, "hello again")
		after := s.routeView(t, sess.GetSessionId())
		require.Equal(t, before.GetWrapperInstance(), after.GetWrapperInstance(), "the same wrapper")
		require.Equal(t, pids, agentProcesses(t, after.GetWrapperInstance()), "the same agent process: no restart")
		require.Positive(t, scanProcs(t, "aph_"))
		scanFiles(t, s.root, "aph_")
	})
}

// acpAgents are the pinned real agents every ACP e2e runs with.
var acpAgents = []string{"opencode", "kilo"}

// forEachAgent runs body as one subtest per pinned agent (run one at a
// time: -run 'TestX/opencode').
func forEachAgent(t *testing.T, body func(t *testing.T, agent string)) {
	for _, agent := range acpAgents {
		t.Run(agent, func(t *testing.T) { body(t, agent) })
	}
}
