// Package scripted is the built-in agent runtime for development and tests
// (`agentplane runtime scripted`). It speaks the JSON-lines stdio protocol of
// docs/runtime-protocol.md and, per delivered message, plays one realistic
// turn: progress, a tool call and its result, streamed message deltas, the
// full message and exactly one outcome. When its route has a proxy URL and a
// handle it calls the proxy's provider route and reports a digest of the
// answer (never the handle).
//
// Message content steers a turn, so tests can exercise every path:
// "fail: ..." ends the turn failed (tool_error), "slow: ..." waits for an
// abort (or 30 s) before answering, "write: <path> <text>" writes the text
// as a file of the worktree, "run: <argv...>" runs a command in the worktree
// (whitespace-separated arguments, 30 s bound) the way an agent's shell
// tool does and reports its exit code and output, and "git: <args...>" runs
// git with the route's handle as its HTTP credential, as an agent that
// uses its handle against the proxy's git route would (the handle is in
// that git's environment only, never in its argv or the repository).
package scripted

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/propagation"

	"agentplane.dev/services/sandbox/internal/agent/command"
	"agentplane.dev/services/sandbox/internal/agent/ingestpost"
	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
)

// Main runs the runtime on stdin/stdout until stdin ends or a shutdown frame
// arrives. It returns the process exit code.
func Main(args []string) int {
	fs := flag.NewFlagSet("scripted", flag.ContinueOnError)
	// History is part of the normal flow (DESIGN.md 2.6), so it is on by
	// default; AGENTPLANE_SCRIPTED_INGEST=0 or --ingest=false turns it off.
	ingest := fs.Bool("ingest", os.Getenv("AGENTPLANE_SCRIPTED_INGEST") != "0",
		"post each turn's history to <proxy>/ingest/v1/sessions/<runtime session>/items (failures tolerated)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	r := &Runtime{
		out:    runtimejsonl.NewWriter(os.Stdout),
		ingest: *ingest,
		http:   &http.Client{Timeout: 30 * time.Second, CheckRedirect: noRedirect},
		routes: map[string]*route{},
	}
	if err := r.Run(os.Stdin); err != nil {
		fmt.Fprintln(os.Stderr, "scripted runtime:", err)
		return 1
	}
	return 0
}

func noRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// Runtime multiplexes routes (sessions) over one process.
type Runtime struct {
	out    *runtimejsonl.Writer
	ingest bool
	http   *http.Client

	mu     sync.Mutex
	routes map[string]*route
	wg     sync.WaitGroup
}

type route struct {
	sessionID, runtimeSessionID, directory string
	handle, proxyURL                       string
	queue                                  chan runtimejsonl.Frame
	mu                                     sync.Mutex
	cancel                                 context.CancelFunc // of the running turn
	turnMessage                            string
	aborted                                map[string]bool // queued messages aborted before their turn
	seq                                    int
}

// Run reads frames from in until EOF or shutdown.
func (r *Runtime) Run(in io.Reader) error {
	defer r.closeAll()
	sc := runtimejsonl.NewScanner(in)
	for sc.Scan() {
		f, err := runtimejsonl.Parse(sc.Bytes())
		if err != nil {
			fmt.Fprintln(os.Stderr, "scripted runtime: skipping bad frame:", err)
			continue
		}
		switch f.Type {
		case runtimejsonl.TypeShutdown:
			return nil
		case runtimejsonl.TypeOpenRoute:
			r.open(f)
		case runtimejsonl.TypeMessage:
			if rt := r.route(f.SessionID); rt != nil {
				rt.queue <- f
			}
		case runtimejsonl.TypeAbort:
			if rt := r.route(f.SessionID); rt != nil {
				rt.abort(f.MessageID)
			}
		case runtimejsonl.TypeCredentials:
			r.mu.Lock()
			for _, id := range f.SessionIDs {
				if rt := r.routes[id]; rt != nil {
					rt.mu.Lock()
					rt.handle = f.Handle
					rt.mu.Unlock()
				}
			}
			r.mu.Unlock()
		case runtimejsonl.TypeCloseRoute:
			r.mu.Lock()
			rt := r.routes[f.SessionID]
			delete(r.routes, f.SessionID)
			r.mu.Unlock()
			if rt != nil {
				rt.abort("")
				close(rt.queue)
			}
		}
	}
	return sc.Err()
}

func (r *Runtime) closeAll() {
	r.mu.Lock()
	for id, rt := range r.routes {
		rt.abort("")
		close(rt.queue)
		delete(r.routes, id)
	}
	r.mu.Unlock()
	r.wg.Wait()
}

func (r *Runtime) route(id string) *route {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.routes[id]
}

func (r *Runtime) open(f runtimejsonl.Frame) {
	r.mu.Lock()
	if rt, ok := r.routes[f.SessionID]; ok {
		rt.mu.Lock()
		rt.handle, rt.proxyURL = f.Handle, f.ProxyURL
		rt.mu.Unlock()
		r.mu.Unlock()
		_ = r.out.Write(runtimejsonl.Frame{Type: runtimejsonl.TypeRouteReady, SessionID: f.SessionID, RuntimeSessionID: rt.runtimeSessionID})
		return
	}
	rsid := f.RuntimeSessionID
	if rsid == "" {
		rsid = "rs_" + randomID()
	}
	rt := &route{
		sessionID: f.SessionID, runtimeSessionID: rsid, directory: f.Directory,
		handle: f.Handle, proxyURL: f.ProxyURL, queue: make(chan runtimejsonl.Frame, 1024),
	}
	r.routes[f.SessionID] = rt
	r.mu.Unlock()
	_ = r.out.Write(runtimejsonl.Frame{Type: runtimejsonl.TypeProgress, SessionID: f.SessionID, Step: "load_session", Detail: "runtime session " + rsid})
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for m := range rt.queue {
			r.turn(rt, m)
		}
	}()
	_ = r.out.Write(runtimejsonl.Frame{Type: runtimejsonl.TypeRouteReady, SessionID: f.SessionID, RuntimeSessionID: rsid})
}

func (rt *route) abort(messageID string) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if rt.cancel != nil && (messageID == "" || messageID == rt.turnMessage) {
		rt.cancel()
		return
	}
	if messageID != "" {
		// Not started yet: its turn ends cancelled as soon as it starts.
		if rt.aborted == nil {
			rt.aborted = map[string]bool{}
		}
		rt.aborted[messageID] = true
	}
}

// turn plays one turn for message m and emits exactly one outcome.
func (r *Runtime) turn(rt *route, m runtimejsonl.Frame) {
	ctx, cancel := context.WithCancel(traceCtx(m.Traceparent))
	rt.mu.Lock()
	rt.cancel, rt.turnMessage = cancel, m.MessageID
	if rt.aborted[m.MessageID] {
		delete(rt.aborted, m.MessageID)
		cancel()
	}
	handle, proxy := rt.handle, rt.proxyURL
	rt.mu.Unlock()
	defer func() {
		cancel()
		rt.mu.Lock()
		rt.cancel, rt.turnMessage = nil, ""
		rt.mu.Unlock()
	}()

	emit := func(kind, text, tool string, data map[string]any) {
		rt.seq++
		_ = r.out.Write(runtimejsonl.Frame{Type: runtimejsonl.TypeEvent, SessionID: rt.sessionID, Event: &runtimejsonl.Event{
			EventID: fmt.Sprintf("%s-%s-%d", rt.runtimeSessionID, m.MessageID, rt.seq), RuntimeSessionID: rt.runtimeSessionID,
			MessageID: m.MessageID, Kind: kind, Text: text, ToolName: tool, Data: data, Time: time.Now().UTC(),
		}})
	}
	outcome := func(result, reason, summary string) {
		_ = r.out.Write(runtimejsonl.Frame{Type: runtimejsonl.TypeOutcome, SessionID: rt.sessionID, Outcome: &runtimejsonl.Outcome{
			TurnID: "turn-" + m.MessageID, RuntimeSessionID: rt.runtimeSessionID, LastMessageID: m.MessageID,
			Result: result, FailureReason: reason, Summary: summary, Time: time.Now().UTC(),
		}})
	}

	emit(runtimejsonl.KindStatus, "busy", "", nil)
	emit(runtimejsonl.KindProgress, "reading the request", "", nil)
	scriptedTools(ctx, rt.directory, m.Content, handle, emit)

	if strings.HasPrefix(m.Content, "slow:") {
		select {
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
		}
	}
	if ctx.Err() != nil {
		emit(runtimejsonl.KindStatus, "idle", "", nil)
		outcome(runtimejsonl.ResultCancelled, "", "aborted")
		return
	}
	if strings.HasPrefix(m.Content, "fail:") {
		emit(runtimejsonl.KindToolResult, "tool failed", "run_command", map[string]any{"exit_code": float64(1)})
		emit(runtimejsonl.KindStatus, "idle", "", nil)
		outcome(runtimejsonl.ResultFailed, "tool_error", "the scripted tool failed")
		return
	}
	if proxy != "" && handle != "" {
		emit(runtimejsonl.KindToolCall, "", "provider", map[string]any{"route": "provider/v1/chat/completions"})
		emit(runtimejsonl.KindToolResult, "", "provider", r.callProvider(ctx, proxy, handle, m.Content))
	}
	reply := "Scripted reply to: " + m.Content
	for _, w := range chunks(reply, 3) {
		emit(runtimejsonl.KindMessageDelta, w, "", nil)
	}
	emit(runtimejsonl.KindMessage, reply, "", nil)
	if r.ingest && proxy != "" && handle != "" {
		r.postHistory(ctx, proxy, handle, rt, m, reply)
	}
	emit(runtimejsonl.KindStatus, "idle", "", nil)
	outcome(runtimejsonl.ResultSucceeded, "", fmt.Sprintf("answered %d characters", len(reply)))
}

// scriptedTools runs the tool steps of a turn in dir: a listing always,
// then what the message's prefix asks for (write:, run:, git:).
func scriptedTools(ctx context.Context, dir, content, handle string, emit func(kind, text, tool string, data map[string]any)) {
	names := listDir(dir)
	emit(runtimejsonl.KindToolCall, "", "list_files", map[string]any{"path": "."})
	emit(runtimejsonl.KindToolResult, "", "list_files", map[string]any{"entries": float64(len(names)), "names": names})
	if rest, ok := strings.CutPrefix(content, "write:"); ok {
		path, text, _ := strings.Cut(strings.TrimSpace(rest), " ")
		emit(runtimejsonl.KindToolCall, "", "write_file", map[string]any{"path": path})
		emit(runtimejsonl.KindToolResult, "", "write_file", writeFile(dir, path, text))
	}
	if rest, ok := strings.CutPrefix(content, "run:"); ok {
		argv := strings.Fields(rest)
		emit(runtimejsonl.KindToolCall, "", "run_command", map[string]any{"argv": strings.Join(argv, " ")})
		emit(runtimejsonl.KindToolResult, "", "run_command", runCommand(ctx, dir, argv))
	}
	if rest, ok := strings.CutPrefix(content, "git:"); ok {
		argv := append([]string{"git"}, strings.Fields(rest)...)
		emit(runtimejsonl.KindToolCall, "", "run_command", map[string]any{"argv": strings.Join(argv, " ")})
		emit(runtimejsonl.KindToolResult, "", "run_command", runCommand(ctx, dir, argv, gitAuth(handle)...))
	}
}

// maxCommandOutput bounds the output a run_command result carries.
const maxCommandOutput = 4 << 10

// runCommand runs argv in dir and returns its exit code and combined
// output (the last maxCommandOutput bytes).
func runCommand(ctx context.Context, dir string, argv []string, env ...string) map[string]any {
	if len(argv) == 0 {
		return map[string]any{"exit_code": float64(-1), "output": "no command"}
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out := &command.Tail{Max: maxCommandOutput}
	cmd := command.New(ctx, command.Spec{Path: argv[0], Args: argv[1:], Dir: dir, Env: append(os.Environ(), env...), Stdout: out, Stderr: out})
	err := cmd.Run()
	code := 0
	if err != nil {
		code = -1
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else {
			_, _ = out.Write([]byte(err.Error()))
		}
	}
	return map[string]any{"exit_code": float64(code), "output": out.String()}
}

// gitAuth is the environment that has git send the handle as bearer on
// every HTTP request (git's GIT_CONFIG_* form of http.extraHeader).
func gitAuth(handle string) []string {
	env := []string{"GIT_TERMINAL_PROMPT=0"}
	if handle == "" {
		return env
	}
	return append(env, "GIT_CONFIG_COUNT=1", "GIT_CONFIG_KEY_0=http.extraHeader", "GIT_CONFIG_VALUE_0=Authorization: Bearer "+handle)
}

// callProvider calls the proxy's OpenAI-compatible route and returns a
// summary: status, size and digest of the body, and the reply text if any.
func (r *Runtime) callProvider(ctx context.Context, proxy, handle, content string) map[string]any {
	body, _ := json.Marshal(map[string]any{
		"model":    "scripted",
		"messages": []map[string]string{{"role": "user", "content": content}},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(proxy, "/")+"/provider/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return map[string]any{"error": "bad proxy url"}
	}
	req.Header.Set("Authorization", "Bearer "+handle)
	req.Header.Set("Content-Type", "application/json")
	propagation.TraceContext{}.Inject(ctx, propagation.HeaderCarrier(req.Header))
	resp, err := r.http.Do(req)
	if err != nil {
		return map[string]any{"error": "proxy unreachable"}
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	sum := sha256.Sum256(data)
	out := map[string]any{"status": float64(resp.StatusCode), "bytes": float64(len(data)), "sha256": hex.EncodeToString(sum[:])}
	var parsed struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &parsed) == nil && len(parsed.Choices) > 0 {
		reply := parsed.Choices[0].Message.Content
		if len(reply) > 200 {
			reply = reply[:200]
		}
		out["reply"] = reply
	}
	return out
}

// historyBudget bounds one turn's history post, its retries included.
const historyBudget = 20 * time.Second

// postHistory posts the turn as ingest items to the proxy's ingest route
// (docs/credential.md): the session item, the user message, the reply with
// its text part, and the route's status. Versions make retries idempotent:
// the session and messages never change (version 1), the status item takes
// the turn's time so a later turn's status wins. A post that failed in
// transit is sent again within historyBudget; a failure after that is
// tolerated and noted on stderr without the handle.
func (r *Runtime) postHistory(ctx context.Context, proxy, handle string, rt *route, m runtimejsonl.Frame, reply string) {
	now := time.Now().UTC()
	item := func(id, typ string, version uint64, parent string, payload map[string]any) map[string]any {
		it := map[string]any{"item_id": id, "type": typ, "version": version, "payload": payload, "time": now}
		if parent != "" {
			it["parent_id"] = parent
		}
		return it
	}
	user, answer := "msg-"+m.MessageID, "reply-"+m.MessageID
	body, _ := json.Marshal(map[string]any{"items": []map[string]any{
		item("session", "session", 1, "", map[string]any{"runtime_session_id": rt.runtimeSessionID, "directory": rt.directory}),
		item(user, "message", 1, "session", map[string]any{"role": "user", "text": m.Content}),
		item(answer, "message", 1, "session", map[string]any{"role": "assistant", "text": reply}),
		item(answer+"-part-0", "part", 1, answer, map[string]any{"kind": "text", "text": reply}),
		item("status", "status", uint64(now.UnixNano()), "session", map[string]any{"state": "idle", "last_message_id": m.MessageID}),
	}})
	// The outcome waits for the history (bounded), so a completed message
	// has its items in ingest unless the budget ran out.
	ctx, cancel := context.WithTimeout(ctx, historyBudget)
	defer cancel()
	if err := ingestpost.Post(ctx, r.http, proxy, handle, rt.runtimeSessionID, body); err != nil {
		fmt.Fprintln(os.Stderr, "scripted runtime: history post failed:", err)
	}
}

// listDir names the route directory's entries (at most 200, .git left
// out), sorted.
func listDir(dir string) []any {
	names := []any{}
	if dir == "" {
		return names
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return names
	}
	for _, e := range entries {
		if e.Name() != ".git" && len(names) < 200 {
			names = append(names, e.Name())
		}
	}
	return names
}

// writeFile writes content (a line of text) to path under the route
// directory, refusing any path that leaves it.
func writeFile(dir, path, content string) map[string]any {
	clean := filepath.Clean("/" + path)
	if dir == "" || path == "" || clean == "/" || strings.HasPrefix(clean, "/.git") {
		return map[string]any{"error": "bad path"}
	}
	full := filepath.Join(dir, clean)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		return map[string]any{"error": "mkdir failed"}
	}
	if err := os.WriteFile(full, []byte(content+"\n"), 0o644); err != nil {
		return map[string]any{"error": "write failed"}
	}
	return map[string]any{"path": clean[1:], "bytes": float64(len(content) + 1)}
}

func chunks(s string, words int) []string {
	fields := strings.SplitAfter(s, " ")
	var out []string
	for i := 0; i < len(fields); i += words {
		end := min(i+words, len(fields))
		out = append(out, strings.Join(fields[i:end], ""))
	}
	return out
}

func randomID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// traceCtx carries the delivery's trace context (a traceparent from the
// wrapper), so the turn's proxy requests continue the caller's trace.
func traceCtx(traceparent string) context.Context {
	return propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": traceparent})
}
