package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/gittest"
	"agentplane.dev/pkg/testenv"
	sandbox "agentplane.dev/services/sandbox/server"
)

// acpPeer drives an ACP agent process directly (the benchmarks' reference:
// what the agent costs without agentplane).
type acpPeer struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan []byte
	next  int
}

func startPeer(b *testing.B, argv []string, env []string, dir string) *acpPeer {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env, cmd.Dir = append(os.Environ(), env...), dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	p := &acpPeer{cmd: cmd, in: in, lines: make(chan []byte, 4096)}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			p.lines <- append([]byte(nil), sc.Bytes()...)
		}
		close(p.lines)
	}()
	b.Cleanup(func() { _ = in.Close(); _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); _ = cmd.Wait() })
	return p
}

// call sends a request; onLine sees every line until the answer to it.
func (p *acpPeer) call(b *testing.B, method string, params any, onLine func([]byte)) json.RawMessage {
	p.next++
	id := p.next
	req, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": method, "params": params})
	if _, err := p.in.Write(append(req, '\n')); err != nil {
		b.Fatal(err)
	}
	timeout := time.After(3 * time.Minute)
	for {
		select {
		case line, ok := <-p.lines:
			if !ok {
				b.Fatalf("%s: the agent exited", method)
			}
			if onLine != nil {
				onLine(line)
			}
			var m struct {
				ID     *int            `json:"id"`
				Method string          `json:"method"`
				Result json.RawMessage `json:"result"`
			}
			if json.Unmarshal(line, &m) == nil && m.Method == "" && m.ID != nil && *m.ID == id {
				return m.Result
			}
		case <-timeout:
			b.Fatalf("%s: no answer", method)
		}
	}
}

func (p *acpPeer) open(b *testing.B, cwd string) string {
	p.call(b, "initialize", map[string]any{"protocolVersion": 1, "clientCapabilities": map[string]any{"fs": map[string]bool{"readTextFile": false, "writeTextFile": false}, "terminal": false}}, nil)
	var res struct {
		SessionID string `json:"sessionId"`
	}
	_ = json.Unmarshal(p.call(b, "session/new", map[string]any{"cwd": cwd, "mcpServers": []any{}}, nil), &res)
	return res.SessionID
}

// chunkStamp reads the Unix-nanosecond stamp fakeacp wrote into a chunk.
func chunkStamp(text string) (time.Time, bool) {
	n, err := strconv.ParseInt(strings.TrimSpace(text), 10, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.Unix(0, n), true
}

func percentiles(b *testing.B, prefix string, d []time.Duration) {
	slices.Sort(d)
	b.ReportMetric(float64(d[len(d)/2].Microseconds())/1000, prefix+"-p50-ms")
	b.ReportMetric(float64(d[len(d)*95/100].Microseconds())/1000, prefix+"-p95-ms")
}

func buildFakeACP(b testing.TB) string {
	dir := b.TempDir()
	// Sandboxes run as their own user: the program must be reachable.
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	bin := filepath.Join(dir, "fakeacp")
	out, err := exec.Command("go", "build", "-o", bin, "agentplane.dev/cmd/agentplane/internal/fakeacp").CombinedOutput()
	if err != nil {
		b.Fatalf("build fakeacp: %v\n%s", err, out)
	}
	return bin
}

// BenchmarkACPUpdateToWatcher (issue 17): the latency agentplane adds
// between an agent's session/update on its stdout and the event at a
// WatchSession subscriber (wrapper → sandbox → session event log →
// stream), side by side with the reference: the same agent's stdout read
// directly. A turn streams 200 chunks 1 ms apart, each stamped with its
// write time (same host clock). Goal: p50 added ≤ 5 ms.
func BenchmarkACPUpdateToWatcher(b *testing.B) {
	bin := buildFakeACP(b)
	const chunks = 200

	// Reference: the agent's pipe alone.
	p := startPeer(b, []string{bin}, nil, b.TempDir())
	sid := p.open(b, b.TempDir())
	var direct []time.Duration
	for range b.N {
		p.call(b, "session/prompt", map[string]any{"sessionId": sid, "prompt": []any{map[string]string{"type": "text", "text": fmt.Sprintf("bench %d", chunks)}}}, func(line []byte) {
			var m struct {
				Params struct {
					Update struct {
						Content struct{ Text string } `json:"content"`
					} `json:"update"`
				} `json:"params"`
			}
			if json.Unmarshal(line, &m) == nil {
				if ts, ok := chunkStamp(m.Params.Update.Content.Text); ok {
					direct = append(direct, time.Since(ts))
				}
			}
		})
	}

	// Through agentplane: the generic acp profile runs the same program.
	s := startSuiteWith(b, fakemodel.New(), func(c *sandbox.Config) { c.AgentACP = bin })
	var sess *sessionv1.Session
	for deadline := time.Now().Add(time.Minute); ; {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-bench", OrgId: "o-e2e", SandboxId: "sbx-acp-lat-" + s.run, Worktree: &sessionv1.Worktree{Directory: "/work/acp-lat"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-bench"},
			Agent:      &sessionv1.Agent{Profile: "acp"},
		})
		if err == nil {
			sess = resp.GetSession()
			break
		}
		if time.Now().After(deadline) {
			b.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	var through []time.Duration
	for i := range b.N + 1 { // the first turn warms the route up; not measured
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sess.GetSessionId(), Cursor: "$"})
		if err != nil {
			b.Fatal(err)
		}
		mid := "m" + strconv.Itoa(i)
		if _, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sess.GetSessionId(), MessageId: mid, Content: fmt.Sprintf("bench %d", chunks)}); err != nil {
			b.Fatal(err)
		}
		for done := false; !done; {
			resp, err := stream.Recv()
			if err != nil {
				b.Fatal(err)
			}
			ev := resp.GetEvent()
			if re := ev.GetRuntimeEvent(); re != nil && i > 0 && re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA {
				if ts, ok := chunkStamp(re.GetText()); ok {
					through = append(through, time.Since(ts))
				}
			}
			if o := ev.GetOutcome(); o != nil && o.GetLastMessageId() == mid {
				done = true
			}
		}
		cancel()
	}
	b.StopTimer()
	percentiles(b, "pipe", direct)
	percentiles(b, "watch", through)
	slices.Sort(direct)
	slices.Sort(through)
	b.ReportMetric(float64((through[len(through)/2]-direct[len(direct)/2]).Microseconds())/1000, "added-p50-ms")
}

// BenchmarkOpenCodeColdFirstEvent (issue 17): cold SendMessage (a new
// sandbox: create it, launch the wrapper, start opencode, initialize,
// session/new, prompt) → the first agent event (a message delta) at a
// WatchSession subscriber, side by side with opencode alone driven directly
// over ACP against the same fake model (spawn → initialize → session/new
// → prompt → first chunk; its start-up, spawn → session/new answered, is
// reported separately). agentplane's share (goal ≤ 100 ms) is the cold
// time minus the agent's own time on that path as the wrapper measured it
// (the busy event's agent_open_ms, and prompt → first chunk): on this
// loaded machine the agent's start-up varies by seconds between runs, far
// more than the share, so a difference of two runs could not show it.
// Also reports the RSS of the idle agent sandbox after the turn
// (wrapper plus the agent's process group).
func BenchmarkOpenCodeColdFirstEvent(b *testing.B) {
	dir := agentsDir(b)
	oc := filepath.Join(dir, "node_modules", "opencode-linux-x64", "bin", "opencode")
	if _, err := os.Stat(oc); err != nil {
		testenv.Missing(b, "pinned opencode is not installed (make agents): %v", err)
	}
	model := fakemodel.New()
	up := httptest.NewServer(model)
	b.Cleanup(up.Close)

	s := startSuiteWith(b, model, func(c *sandbox.Config) { c.AgentsDir, c.AgentModel = dir, "fake-model" })
	s.create(b, "sbx-warm", "/work/w", "sk-warm") // the services are up
	var startup, direct, cold, share []time.Duration
	var rss []float64
	for i := range b.N {
		// Each iteration measures the reference right before the cold
		// session, so both see the same machine state; the share is the
		// median of the per-iteration differences.
		st, first := directFirstEvent(b, oc, up.URL)
		startup, direct = append(startup, st), append(direct, first)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		resp, err := s.ses.CreateSession(ctx, &sessionv1.CreateSessionRequest{
			UserId: "u-cold", OrgId: "o-e2e", SandboxId: fmt.Sprintf("sbx-oc-cold-%s-%d", s.run, i), Worktree: &sessionv1.Worktree{Directory: "/work/oc-cold"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-cold"},
			Agent:      &sessionv1.Agent{Profile: "opencode"},
		})
		if err != nil {
			b.Fatal(err)
		}
		id := resp.GetSession().GetSessionId()
		tt := timeTurn(ctx, b, s, id, "m1")
		cold = append(cold, tt.firstDelta)
		// The agent's own time on this path: opening (start-up not hidden
		// behind agentplane's work, session/new) and prompt → first chunk
		// read by the wrapper (which also holds the model's answer through
		// the relay and proxy: counted as the agent's, so the share is a
		// lower bound by that hop).
		share = append(share, tt.firstDelta-tt.agentOpen()-tt.promptToDelta)
		cancel()
		// The sandbox is idle now: the wrapper and the agent's group.
		got, err := s.ses.GetSession(context.Background(), &sessionv1.GetSessionRequest{SessionId: id})
		if err != nil {
			b.Fatal(err)
		}
		inst := got.GetSession().GetRoute().GetWrapperInstance()
		time.Sleep(2 * time.Second)
		total := rssKiB(wrapperProcessB(b, inst))
		for _, pid := range agentGroupPIDs(inst) {
			total += rssKiB(pid)
		}
		rss = append(rss, float64(total)/1024)
	}
	b.StopTimer()
	percentiles(b, "agent-startup", startup)
	percentiles(b, "direct-first-event", direct)
	percentiles(b, "cold-first-event", cold)
	slices.Sort(share)
	slices.Sort(rss)
	b.ReportMetric(float64(share[len(share)/2].Microseconds())/1000, "agentplane-share-p50-ms")
	b.ReportMetric(rss[len(rss)/2], "idle-sandbox-rss-MB")
}

// turnTiming is one turn as a WatchSession subscriber saw it.
type turnTiming struct {
	firstDelta    time.Duration  // SendMessage → the first message delta at the subscriber
	busy          map[string]any // the busy event's data: where opening the route waited on the agent
	promptToDelta time.Duration  // the wrapper's clock: the prompt sent (busy) → the first delta read
}

// ms returns a duration the busy event's data carries in milliseconds.
func (tt turnTiming) ms(key string) time.Duration {
	v, _ := tt.busy[key].(float64)
	return time.Duration(v * float64(time.Millisecond))
}

func (tt turnTiming) agentOpen() time.Duration { return tt.ms("agent_open_ms") }

// timeTurn sends messageID to the session and follows WatchSession until
// the turn's outcome.
func timeTurn(ctx context.Context, b testing.TB, s *suite, id, messageID string) turnTiming {
	stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: id})
	if err != nil {
		b.Fatal(err)
	}
	t0 := time.Now()
	if _, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, MessageId: messageID, Content: "hello"}); err != nil {
		b.Fatal(err)
	}
	var tt turnTiming
	var busyAt time.Time
	measured := false
	for {
		r, err := stream.Recv()
		if err != nil {
			b.Fatal(err)
		}
		ev := r.GetEvent()
		if ev.GetOutcome() != nil && ev.GetOutcome().GetLastMessageId() == messageID {
			return tt
		}
		re := ev.GetRuntimeEvent()
		if re.GetMessageId() != messageID {
			continue // an earlier turn's, replayed
		}
		if re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_STATUS && re.GetText() == "busy" {
			busyAt, tt.busy = re.GetTime().AsTime(), re.GetData().AsMap()
		}
		if !measured && re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA {
			tt.firstDelta, measured = time.Since(t0), true
			tt.promptToDelta = re.GetTime().AsTime().Sub(busyAt)
		}
	}
}

// BenchmarkOpenCodeResumedFirstEvent (DESIGN.md 3.8, without a warm pool):
// an opencode session that answered one turn is suspended (SuspendSession:
// no process of its sandbox runs), then SendMessage → the first agent event
// at a WatchSession subscriber, which relaunches the wrapper and opencode,
// initializes it and session/loads the conversation. Reports where the time
// goes from the first turn's busy event: the agent's start-up and
// initialize, session/load, and prompt → first chunk; and the same for the
// cold first turn before it (session/new).
func BenchmarkOpenCodeResumedFirstEvent(b *testing.B) {
	dir := requireAgent(b, "opencode")
	s := startSuiteWith(b, fakemodel.New(), func(c *sandbox.Config) { c.AgentsDir, c.AgentModel = dir, "fake-model" })
	var cold, coldStart, coldSession, resumed, resumedStart, resumedLoad, resumedPrompt []time.Duration
	for i := range b.N {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		id := s.createAgent(b, fmt.Sprintf("sbx-oc-resume-%d", i), "/work/oc-resume", "sk-resume", "opencode").GetSessionId()
		c := timeTurn(ctx, b, s, id, "m1")
		cold, coldStart, coldSession = append(cold, c.firstDelta), append(coldStart, c.ms("agent_start_ms")), append(coldSession, c.ms("agent_session_ms"))
		got, err := s.suspend(b, id, false)
		if err != nil || got.GetRoute().GetState() != sessionv1.RouteState_ROUTE_STATE_SUSPENDED {
			b.Fatalf("suspend: %v (route %v)", err, got.GetRoute().GetState())
		}
		r := timeTurn(ctx, b, s, id, "m2")
		if loaded, _ := r.busy["agent_session_loaded"].(bool); !loaded {
			b.Fatalf("the resumed turn did not session/load: busy %v", r.busy)
		}
		resumed, resumedStart = append(resumed, r.firstDelta), append(resumedStart, r.ms("agent_start_ms"))
		resumedLoad, resumedPrompt = append(resumedLoad, r.ms("agent_session_ms")), append(resumedPrompt, r.promptToDelta)
		cancel()
		s.deleteSession(b, id)
	}
	b.StopTimer()
	percentiles(b, "cold-first-event", cold)
	percentiles(b, "cold-agent-start", coldStart)
	percentiles(b, "cold-session-new", coldSession)
	percentiles(b, "resumed-first-event", resumed)
	percentiles(b, "resumed-agent-start", resumedStart)
	percentiles(b, "resumed-session-load", resumedLoad)
	percentiles(b, "resumed-prompt-to-delta", resumedPrompt)
}

// directFirstEvent runs opencode alone over ACP: spawn → initialize →
// session/new (its start-up) → prompt → first chunk.
func directFirstEvent(b *testing.B, oc, upURL string) (startup, first time.Duration) {
	home := b.TempDir()
	cfg := filepath.Join(home, "opencode.json")
	text := strings.NewReplacer("{{BASE_URL}}", upURL+"/v1", "{{API_KEY}}", "k", "{{MODEL}}", "fake-model").Replace(openCodeTemplate)
	if err := os.WriteFile(cfg, []byte(text), 0o600); err != nil {
		b.Fatal(err)
	}
	ws := b.TempDir()
	t0 := time.Now()
	p := startPeer(b, []string{oc, "acp"}, []string{"HOME=" + home, "OPENCODE_CONFIG=" + cfg}, ws)
	sid := p.open(b, ws)
	startup = time.Since(t0)
	p.call(b, "session/prompt", map[string]any{"sessionId": sid, "prompt": []any{map[string]string{"type": "text", "text": "hello"}}}, func(line []byte) {
		if first == 0 && strings.Contains(string(line), `"agent_message_chunk"`) {
			first = time.Since(t0)
		}
	})
	_ = p.in.Close()
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	return startup, first
}

// openCodeTemplate is the profile's provider config (internal/agent/agents).
const openCodeTemplate = `{"provider":{"agentplane":{"npm":"@ai-sdk/openai-compatible","name":"agentplane","options":{"baseURL":"{{BASE_URL}}","apiKey":"{{API_KEY}}"},"models":{"{{MODEL}}":{"name":"{{MODEL}}"}}}},"enabled_providers":["agentplane"],"autoupdate":false,"share":"disabled","model":"agentplane/{{MODEL}}"}`

// rssKiB is a process's resident set size, 0 when it is gone.
func rssKiB(pid int) int { return procKiB(pid, "status", "VmRSS:") }

// procKiB is the kB figure of key's line in /proc/<pid>/<file>, 0 when the
// process is gone.
func procKiB(pid int, file, key string) int {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), file))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key); ok {
			n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			return n
		}
	}
	return 0
}

// agentGroupPIDs lists every process whose environment names the wrapper
// instance as its runtime parent (the agent and its children).
func agentGroupPIDs(instance string) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err == nil && slices.Contains(strings.Split(string(env), "\x00"), "AGENTPLANE_RUNTIME_PARENT="+instance) {
			pid, _ := strconv.Atoi(e.Name())
			out = append(out, pid)
		}
	}
	return out
}

func wrapperProcessB(b *testing.B, instance string) int {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err == nil && slices.Contains(strings.Split(string(env), "\x00"), "AGENTPLANE_INSTANCE="+instance) {
			pid, _ := strconv.Atoi(e.Name())
			return pid
		}
	}
	b.Fatalf("no wrapper with instance %s", instance)
	return 0
}

// BenchmarkOpenCodeColdFirstEventWithClone: a cold opencode session whose
// worktree is a clone of a 40 MB repository (git http-backend, through the
// credential proxy's git route): SendMessage → the first message delta.
// The wrapper clones, then starts the agent (docs/benchmarks.md "Cold
// first event with a clone": starting it first was measured no faster).
//
//	cd cmd/agentplane && go test ./e2e -run '^$' -bench '^BenchmarkOpenCodeColdFirstEventWithClone$' -benchtime 3x -timeout 15m
func BenchmarkOpenCodeColdFirstEventWithClone(b *testing.B) {
	dir := requireAgent(b, "opencode")
	s := startSuiteWith(b, fakemodel.New(), func(c *sandbox.Config) { c.AgentsDir, c.AgentModel = dir, "fake-model" })
	token := "ghs_bench" + newSecret()
	g := gittest.Start(b, token)
	bigRepo(b, g, "org/big.git", 8, 5<<20)

	var first []time.Duration
	for i := range b.N {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		var id string
		require.Eventually(b, func() bool {
			resp, err := s.ses.CreateSession(ctx, &sessionv1.CreateSessionRequest{
				UserId: "u-e2e", OrgId: "o-e2e", SandboxId: fmt.Sprintf("sbx-oc-clone-%s-%d", s.run, i),
				Worktree:      &sessionv1.Worktree{Directory: "/work/oc-clone", RepoUrl: g.RepoURL("org/big.git")},
				Credential:    &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-clone"},
				GitCredential: &sessionv1.GitCredentialInput{Token: token},
				Agent:         &sessionv1.Agent{Profile: "opencode"},
			})
			id = resp.GetSession().GetSessionId()
			return err == nil
		}, 30*time.Second, 50*time.Millisecond)
		first = append(first, timeTurn(ctx, b, s, id, "m1").firstDelta)
		cancel()
		s.deleteSession(b, id)
	}
	b.StopTimer()
	percentiles(b, "cold-first-event-with-clone", first)
}
