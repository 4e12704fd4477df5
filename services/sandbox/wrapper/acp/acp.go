// Package acp is the runtime driver for coding agents that speak the Agent
// Client Protocol (JSON-RPC 2.0, one object per line on stdio): opencode,
// Kilo CLI, or any ACP agent given by its command line (DESIGN.md 3.7).
//
// The wrapper is the ACP client. One agent process serves every route of
// the runtime key: `initialize` (no fs or terminal client capabilities, so
// the agent uses its own tools inside the sandbox), an opened route is
// `session/new {cwd}` or `session/load` when the route's runtime session is
// known and the agent offers loadSession, a message is `session/prompt`,
// abort is `session/cancel` (open permission requests are answered
// cancelled), a closed route is `session/close` where offered. Updates
// become RuntimeEvents (mapping.go), the prompt's stopReason exactly one
// TurnOutcome, and each turn's history is posted to ingest through the
// proxy (history.go).
//
// The agent's provider is the wrapper's loopback relay (package relay): its
// config file names the relay and a dummy key; the handle stays in the
// wrapper.
package acp

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
	"agentplane.dev/services/sandbox/wrapper/providerrelay"
	"agentplane.dev/services/sandbox/wrapper/runtimedriver"
)

// ProtocolVersion is the ACP version the wrapper asks for.
const ProtocolVersion = 1

// Turn failure and route failure reasons (lower snake, docs/runtime-protocol.md).
const (
	ReasonProtocol    = "agent_protocol_error"     // a line that is not JSON-RPC, a second answer
	ReasonExited      = "agent_exited"             // the agent process ended
	ReasonInitTimeout = "agent_initialize_timeout" // initialize was not answered in time
	ReasonInitFailed  = "agent_initialize_failed"
	ReasonSession     = "agent_session_failed" // session/new or session/load failed
	ReasonAgentError  = "agent_error"          // session/prompt answered with an error
)

// ConversationRestarted is the text of the status event (outside any turn)
// a route gets when the agent could not continue the session's earlier
// conversation and opened a new one; its data names the reason.
const ConversationRestarted = "conversation_restarted"

// Why a route's earlier agent session was not continued.
const (
	RestartNoLoad     = "agent_cannot_load_session" // the agent does not offer loadSession
	RestartLoadFailed = "agent_session_load_failed" // session/load answered an error
)

// Config of the driver.
type Config struct {
	Spec agents.Spec
	// Home is where the agent's provider config and the session map are
	// written (the sandbox home); empty: $HOME.
	Home string
	// InitTimeout bounds initialize, and each session/new or session/load.
	InitTimeout time.Duration
	// Client posts history to the proxy; nil: a default client.
	Client *http.Client
	Logger *slog.Logger
	// Nest runs the agent in the nested sandbox (nil: none).
	Nest *runtimedriver.Nest
	// PrepareSession, for a pooled agent (DESIGN.md 3.8), is the directory
	// of a session/new made right after initialize, before any route: the
	// first new route at that directory takes it instead of waiting for
	// its own. Empty: none.
	PrepareSession string
}

// Starter starts the agent of cfg.
func Starter(cfg Config) runtimedriver.Starter {
	return func(instance string, h runtimedriver.Hooks) (runtimedriver.Runtime, error) {
		return start(cfg, instance, h)
	}
}

// Runtime is a running agent.
type Runtime struct {
	cfg   Config
	hooks runtimedriver.Hooks
	log   *slog.Logger
	relay *providerrelay.Relay
	rpc   *conn
	store *sessionStore
	http  *http.Client

	pgid   int
	stdin  io.Closer
	exited chan struct{}
	once   sync.Once

	ready    chan struct{} // closed when initialize ended (initErr says how)
	initErr  *failure
	initDone time.Time // when initialize was answered
	caps     agentCapabilities

	prefix string // event-id prefix unique to this process
	seq    atomic.Uint64

	// busy counts running opens and turns: their route failures and
	// outcomes go out before OnExit, so a turn fails with its own reason.
	busy sync.WaitGroup

	emitMu sync.Mutex // OnFrame is called by one goroutine at a time

	mu     sync.Mutex
	routes map[string]*route // by agentplane session id
	byACP  map[string]*route // by ACP session id
	// opening: a route being opened, closed when that open ended. A
	// repeated open_route waits for it instead of opening a second ACP
	// session.
	opening map[string]chan struct{}
	// spare is the session PrepareSession made ("" once taken, or if
	// none was made); spareReady closes when its session/new ended.
	spare      string
	spareReady chan struct{}
	broken     *failure // why the connection ended
	stopping   bool     // Stop was called: the wrapper ends the agent
}

// failure is a named reason with a detail (no secrets).
type failure struct{ reason, detail string }

func (f *failure) Error() string { return f.reason + ": " + f.detail }

type agentCapabilities struct {
	LoadSession         bool `json:"loadSession"`
	SessionCapabilities struct {
		Close *struct{} `json:"close"`
	} `json:"sessionCapabilities"`
}

type route struct {
	sessionID, rsid, acpID, dir string
	reject                      []string
	queue                       chan runtimejsonl.Frame
	loading                     atomic.Bool // session/load replays history: not events of a turn

	mu      sync.Mutex
	turn    *turn
	aborted map[string]bool // messages aborted before their turn started
	closed  bool
	names   toolNames
	// agentOpen is how long opening the route waited on the agent itself
	// (the rest of initialize, session/new or load); the route's first
	// turn reports it, so agentplane's own share of a cold start can be
	// told from the agent's. agentStart is the part spent waiting for the
	// agent's start-up and initialize, agentSession the session/new or
	// session/load (loaded says which): where a cold or resumed start goes.
	agentOpen, agentStart, agentSession time.Duration
	loaded                              bool
	reported                            bool
	// restarted says why the route's earlier agent session could not be
	// loaded ("" when it was, or when there was none): the route opens a
	// new one and the session is told (conversation_restarted).
	restarted, prevACP string
}

type turn struct {
	messageID string
	cancelled bool
	text      strings.Builder
	tools     []*toolRecord
	byTool    map[string]*toolRecord
	perms     map[string]*json.RawMessage // open permission requests by id text
}

type toolRecord struct {
	ID, Title, Kind, Status string
	Input, Output           any
}

func start(cfg Config, instance string, h runtimedriver.Hooks) (*Runtime, error) {
	if len(cfg.Spec.Command) == 0 {
		return nil, errors.New("acp: no agent command")
	}
	if cfg.InitTimeout <= 0 {
		cfg.InitTimeout = 2 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Home == "" {
		cfg.Home = os.Getenv("HOME")
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: 30 * time.Second,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	state := filepath.Join(cfg.Home, ".agentplane")
	if err := os.MkdirAll(state, 0o700); err != nil {
		return nil, fmt.Errorf("acp: state directory: %w", err)
	}
	rl, err := providerrelay.Start()
	if err != nil {
		return nil, fmt.Errorf("acp: relay: %w", err)
	}
	var extra []string
	extra = append(extra, cfg.Spec.Env...)
	if cfg.Spec.ConfigEnv != "" && cfg.Spec.ConfigTemplate != "" {
		file := filepath.Join(state, cfg.Spec.Profile+"-config.json")
		text := agents.Render(cfg.Spec.ConfigTemplate, rl.BaseURL(), cfg.Spec.Model, providerrelay.DummyKey)
		if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
			_ = rl.Close()
			return nil, fmt.Errorf("acp: write agent config: %w", err)
		}
		extra = append(extra, cfg.Spec.ConfigEnv+"="+file)
	}
	cmd, err := runtimedriver.Command(cfg.Spec.Command, instance, extra, cfg.Nest)
	if err != nil {
		_ = rl.Close()
		return nil, err
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		_ = rl.Close()
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		_ = rl.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		_ = rl.Close()
		return nil, err
	}
	r := &Runtime{
		cfg: cfg, hooks: h, log: cfg.Logger.With("agent", cfg.Spec.Profile), relay: rl, rpc: newConn(stdin),
		store: &sessionStore{file: filepath.Join(state, "acp-sessions.json")}, http: cfg.Client,
		pgid: cmd.Process.Pid, stdin: stdin, exited: make(chan struct{}), ready: make(chan struct{}),
		prefix: randomHex(4), routes: map[string]*route{}, byACP: map[string]*route{}, opening: map[string]chan struct{}{}, spareReady: make(chan struct{}),
	}
	go r.read(stdout, cmd)
	go r.initialize()
	return r, nil
}

// read is the only reader of the agent's stdout. A line that is not
// JSON-RPC breaks the connection: pending calls fail with
// agent_protocol_error and the agent is stopped (its routes are prepared
// again on a new one, DESIGN.md 3.1).
func (r *Runtime) read(stdout io.Reader, cmd interface{ Wait() error }) {
	sc := newScanner(stdout)
	var why *failure
	for sc.Scan() {
		m, err := parseMessage(sc.Bytes())
		if err == nil && m.Method == "" {
			err = r.rpc.deliver(m)
		}
		if err != nil {
			why = &failure{ReasonProtocol, err.Error()}
			break
		}
		if m.Method != "" {
			r.dispatch(m)
		}
	}
	if why == nil {
		why = &failure{ReasonExited, "the agent closed its output"}
		if err := sc.Err(); err != nil {
			why = &failure{ReasonProtocol, "unreadable output: " + err.Error()}
		}
	}
	r.mu.Lock()
	if r.broken == nil {
		r.broken = why
	}
	r.mu.Unlock()
	r.log.Warn("agent connection ended", "reason", why.reason, "detail", why.detail)
	r.rpc.close(why)
	if why.reason == ReasonProtocol {
		r.kill()
	}
	// Running turns fail with the reason first; then the wrapper learns the
	// runtime is gone and fails its routes.
	r.busy.Wait()
	r.failRoutes(why)
	_ = cmd.Wait()
	_ = r.relay.Close()
	close(r.exited)
	r.hooks.OnExit()
}

// failRoutes fails the open routes with why (agent_protocol_error,
// agent_exited), retryable: the route is prepared again on a new agent,
// and the session sees the reason rather than the wrapper's generic
// runtime_exited. Not when the wrapper itself stopped the agent.
func (r *Runtime) failRoutes(why *failure) {
	r.mu.Lock()
	ids := make([]string, 0, len(r.routes))
	if !r.stopping {
		for id := range r.routes {
			ids = append(ids, id)
		}
	}
	r.mu.Unlock()
	slices.Sort(ids)
	for _, id := range ids {
		r.routeFailed(id, why, true)
	}
}

// call sends a request and waits for its answer, at most timeout (0: no
// bound but the connection's end).
func (r *Runtime) call(method string, params any, timeout time.Duration, out any) error {
	id, ch, err := r.rpc.start(method, params)
	if err != nil {
		return err
	}
	var timer <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		timer = t.C
	}
	select {
	case resp := <-ch:
		if resp.err != nil {
			return resp.err
		}
		if out != nil {
			if err := json.Unmarshal(resp.result, out); err != nil {
				return &failure{ReasonProtocol, method + " answered a malformed result"}
			}
		}
		return nil
	case <-timer:
		r.rpc.forget(id)
		return errTimeout
	}
}

var errTimeout = errors.New("acp: no answer in time")

// ms is d in milliseconds, as an event's data carries durations.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func (r *Runtime) initialize() {
	var res struct {
		ProtocolVersion   int               `json:"protocolVersion"`
		AgentCapabilities agentCapabilities `json:"agentCapabilities"`
	}
	err := r.call("initialize", map[string]any{
		"protocolVersion": ProtocolVersion,
		// No fs or terminal: the agent reads, writes and runs with its own
		// tools, inside the sandbox.
		"clientCapabilities": map[string]any{"fs": map[string]bool{"readTextFile": false, "writeTextFile": false}, "terminal": false},
		"clientInfo":         map[string]string{"name": "agentplane", "version": "1"},
	}, r.cfg.InitTimeout, &res)
	switch {
	case errors.Is(err, errTimeout):
		r.initErr = &failure{ReasonInitTimeout, fmt.Sprintf("initialize not answered within %s", r.cfg.InitTimeout)}
	case err != nil:
		r.initErr = asFailure(err, ReasonInitFailed)
	default:
		r.caps = res.AgentCapabilities
	}
	r.initDone = time.Now()
	close(r.ready)
	if r.initErr != nil {
		r.log.Warn("agent initialize failed", "reason", r.initErr.reason, "detail", r.initErr.detail)
		r.kill()
		return
	}
	if r.cfg.PrepareSession != "" {
		r.prepareSpare()
	}
}

// prepareSpare makes the session of PrepareSession. A failure only costs
// the first route its own session/new.
func (r *Runtime) prepareSpare() {
	defer close(r.spareReady)
	var res struct {
		SessionID string `json:"sessionId"`
	}
	if err := r.call("session/new", map[string]any{"cwd": r.cfg.PrepareSession, "mcpServers": []any{}}, r.cfg.InitTimeout, &res); err != nil {
		r.log.Warn("no agent session prepared ahead of the first route", "err", asFailure(err, ReasonSession).detail)
		return
	}
	r.mu.Lock()
	r.spare = res.SessionID
	r.mu.Unlock()
}

// takeSpare waits for the prepared session, if one is being made for dir,
// and takes it ("" when there is none).
func (r *Runtime) takeSpare(dir string) string {
	if r.cfg.PrepareSession == "" || dir != r.cfg.PrepareSession {
		return ""
	}
	select {
	case <-r.spareReady:
	case <-r.exited:
		return ""
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	id := r.spare
	r.spare = ""
	return id
}

// asFailure names an error: a connection failure keeps its reason, an
// agent's error answer becomes def.
func asFailure(err error, def string) *failure {
	var f *failure
	if errors.As(err, &f) {
		return f
	}
	var re *rpcError
	if errors.As(err, &re) {
		return &failure{def, re.Message}
	}
	if errors.Is(err, errTimeout) {
		return &failure{def, "no answer in time"}
	}
	return &failure{def, err.Error()}
}

// Send takes one wrapper frame; it never blocks on the agent.
func (r *Runtime) Send(f runtimejsonl.Frame) error {
	switch f.Type {
	case runtimejsonl.TypeOpenRoute:
		_ = r.relay.Set(f.ProxyURL, f.Handle)
		r.busy.Add(1)
		go func() {
			defer r.busy.Done()
			r.open(f)
		}()
	case runtimejsonl.TypeMessage:
		rt := r.route(f.SessionID)
		if rt == nil {
			return errors.New("acp: message for a route that is not open")
		}
		select {
		case rt.queue <- f:
		default:
			return errors.New("acp: route queue full")
		}
	case runtimejsonl.TypeAbort:
		if rt := r.route(f.SessionID); rt != nil {
			r.abort(rt, f.MessageID)
		}
	case runtimejsonl.TypeCredentials:
		// One agent process, one relay: under the worktree contract every
		// route of it shares the canonical handle.
		_ = r.relay.Set("", f.Handle)
	case runtimejsonl.TypeCloseRoute:
		r.closeRoute(f.SessionID)
	case runtimejsonl.TypeShutdown:
		go r.Stop()
	}
	return nil
}

func (r *Runtime) route(id string) *route {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.routes[id]
}

func (r *Runtime) emit(f runtimejsonl.Frame) {
	r.emitMu.Lock()
	defer r.emitMu.Unlock()
	r.hooks.OnFrame(f)
}

func (r *Runtime) progress(id, step, detail string) {
	r.emit(runtimejsonl.Frame{Type: runtimejsonl.TypeProgress, SessionID: id, Step: step, Detail: detail})
}

func (r *Runtime) routeFailed(id string, f *failure, retryable bool) {
	r.emit(runtimejsonl.Frame{Type: runtimejsonl.TypeRouteFailed, SessionID: id, Reason: f.reason, Detail: f.detail, Retryable: retryable})
}

// open answers open_route: session/new, or session/load of the ACP session
// the route's runtime session had before (a restarted wrapper).
func (r *Runtime) open(f runtimejsonl.Frame) {
	id := f.SessionID
	existing, end := r.beginOpen(id)
	if existing != nil {
		r.reopen(existing, f)
		return
	}
	defer end()
	waited, fail := r.awaitAgent(id)
	if fail != nil {
		r.routeFailed(id, fail, true)
		return
	}
	rsid := f.RuntimeSessionID
	if rsid == "" {
		rsid = "rs_" + randomHex(8)
	}
	rt := &route{sessionID: id, rsid: rsid, dir: f.Directory, reject: f.RejectToolKinds,
		queue: make(chan runtimejsonl.Frame, 1024), aborted: map[string]bool{}, names: toolNames{}}
	took, fail := r.startAgentSession(rt)
	if fail != nil {
		r.routeFailed(id, fail, true)
		return
	}
	rt.agentOpen, rt.agentStart, rt.agentSession = waited+took, waited, took
	r.addRoute(rt)
}

// beginOpen waits until no other open of the session runs. It returns the
// route served meanwhile, or end, which this open calls when it ended
// (served or failed: a waiting repeat then reopens or opens again).
func (r *Runtime) beginOpen(id string) (existing *route, end func()) {
	for {
		r.mu.Lock()
		if rt := r.routes[id]; rt != nil {
			r.mu.Unlock()
			return rt, nil
		}
		wait, busy := r.opening[id]
		if !busy {
			done := make(chan struct{})
			r.opening[id] = done
			r.mu.Unlock()
			return nil, func() {
				r.mu.Lock()
				delete(r.opening, id)
				r.mu.Unlock()
				close(done)
			}
		}
		r.mu.Unlock()
		<-wait
	}
}

// reopen answers open_route for a route already served: only the tool kinds
// it rejects can change.
func (r *Runtime) reopen(rt *route, f runtimejsonl.Frame) {
	rt.mu.Lock()
	rt.reject = f.RejectToolKinds
	rt.mu.Unlock()
	r.routeReady(rt.sessionID, rt.rsid)
}

// awaitAgent waits until the agent answered initialize or exited, and says
// how long the route waited for it: up to initialize's answer, not to when
// this goroutine noticed.
func (r *Runtime) awaitAgent(id string) (time.Duration, *failure) {
	r.progress(id, "initialize_agent", "waiting for the agent to start")
	openStart := time.Now()
	select {
	case <-r.ready:
	case <-r.exited:
	}
	waited := time.Since(openStart)
	select {
	case <-r.ready: // initDone and initErr are written before ready closes
		if !r.initDone.IsZero() {
			waited = max(0, r.initDone.Sub(openStart))
		}
		if r.initErr != nil {
			return waited, r.initErr
		}
	default: // exited first: initialize may still be writing initErr
	}
	return waited, r.brokenReason()
}

// startAgentSession gives the route its ACP session and says how long the
// agent took to open it. Keyed by the agentplane session, not the runtime
// session: a route prepared again gets a new runtime session id, and the
// agent's conversation still continues.
func (r *Runtime) startAgentSession(rt *route) (time.Duration, *failure) {
	prev := r.store.get(rt.sessionID)
	if prev == "" {
		return r.newSession(rt)
	}
	if !r.caps.LoadSession {
		rt.restarted, rt.prevACP = RestartNoLoad, prev
		return r.newSession(rt)
	}
	took, err := r.loadSession(rt, prev)
	if err == nil {
		rt.loaded = true
		return took, nil
	}
	r.log.Warn("session/load failed; starting a new agent session", "session", rt.sessionID, "err", asFailure(err, ReasonSession).detail)
	if b := r.brokenReason(); b != nil {
		return took, b
	}
	rt.restarted, rt.prevACP = RestartLoadFailed, prev
	more, fail := r.newSession(rt)
	return took + more, fail
}

// loadSession resumes the agent session prev for the route. The route is
// findable by prev while the agent replays the conversation, which it marks
// as loading rather than events of a turn.
func (r *Runtime) loadSession(rt *route, prev string) (time.Duration, error) {
	r.progress(rt.sessionID, "load_session", "resuming agent session "+prev)
	rt.acpID = prev
	rt.loading.Store(true)
	r.mu.Lock()
	r.byACP[prev] = rt
	r.mu.Unlock()
	t := time.Now()
	err := r.call("session/load", map[string]any{"sessionId": prev, "cwd": rt.dir, "mcpServers": []any{}}, r.cfg.InitTimeout, nil)
	took := time.Since(t)
	rt.loading.Store(false)
	if err != nil {
		r.mu.Lock()
		delete(r.byACP, prev)
		r.mu.Unlock()
	}
	return took, err
}

// newSession opens a new agent session for the route (or gives it the one
// prepared ahead, PrepareSession).
func (r *Runtime) newSession(rt *route) (time.Duration, *failure) {
	r.progress(rt.sessionID, "new_session", "opening an agent session")
	t := time.Now()
	if id := r.takeSpare(rt.dir); id != "" {
		rt.acpID = id
		return time.Since(t), nil
	}
	var res struct {
		SessionID string `json:"sessionId"`
	}
	err := r.call("session/new", map[string]any{"cwd": rt.dir, "mcpServers": []any{}}, r.cfg.InitTimeout, &res)
	took := time.Since(t)
	if err == nil && res.SessionID == "" {
		err = &failure{ReasonProtocol, "session/new answered without a sessionId"}
	}
	if err != nil {
		return took, asFailure(err, ReasonSession)
	}
	rt.acpID = res.SessionID
	return took, nil
}

// addRoute records the route's agent session for a restarted wrapper, then
// serves the route and answers route_ready.
func (r *Runtime) addRoute(rt *route) {
	// One open of a session at a time (open), so this is the route's ACP
	// session: a restarted wrapper loads it.
	if err := r.store.put(rt.sessionID, rt.acpID); err != nil {
		r.log.Warn("could not record the agent session", "session", rt.sessionID, "err", err)
	}
	r.mu.Lock()
	r.routes[rt.sessionID] = rt
	r.byACP[rt.acpID] = rt
	r.mu.Unlock()
	r.routeReady(rt.sessionID, rt.rsid)
	if rt.restarted != "" {
		// Before the route's first turn (serveRoute starts below), so the
		// session sees the break ahead of the answer that lacks the context.
		r.event(rt, "", mapped{kind: runtimejsonl.KindStatus, text: ConversationRestarted,
			data: map[string]any{"reason": rt.restarted, "previous_agent_session_id": rt.prevACP, "agent_session_id": rt.acpID}})
	}
	go r.serveRoute(rt)
}

func (r *Runtime) routeReady(id, rsid string) {
	r.emit(runtimejsonl.Frame{Type: runtimejsonl.TypeRouteReady, SessionID: id, RuntimeSessionID: rsid})
}

func (r *Runtime) brokenReason() *failure {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.broken
}

// serveRoute plays the route's messages one turn at a time.
func (r *Runtime) serveRoute(rt *route) {
	for m := range rt.queue {
		r.busy.Add(1)
		r.playTurn(rt, m)
		r.busy.Done()
	}
}

// playTurn sends one prompt and emits exactly one outcome for it.
func (r *Runtime) playTurn(rt *route, m runtimejsonl.Frame) {
	t := &turn{messageID: m.MessageID, byTool: map[string]*toolRecord{}, perms: map[string]*json.RawMessage{}}
	rt.mu.Lock()
	if rt.aborted[m.MessageID] || rt.closed {
		delete(rt.aborted, m.MessageID)
		rt.mu.Unlock()
		r.outcome(rt, m.MessageID, runtimejsonl.ResultCancelled, "", "aborted before it started")
		return
	}
	rt.turn = t
	var busy map[string]any
	if !rt.reported {
		rt.reported = true
		busy = map[string]any{"agent_open_ms": ms(rt.agentOpen), "agent_start_ms": ms(rt.agentStart),
			"agent_session_ms": ms(rt.agentSession), "agent_session_loaded": rt.loaded}
	}
	rt.mu.Unlock()
	r.event(rt, t.messageID, mapped{kind: runtimejsonl.KindStatus, text: "busy", data: busy})
	r.relay.SetTraceparent(m.Traceparent)

	var res struct {
		StopReason string `json:"stopReason"`
	}
	err := r.call("session/prompt", map[string]any{
		"sessionId": rt.acpID,
		"prompt":    []any{map[string]string{"type": "text", "text": m.Content}},
	}, 0, &res)

	rt.mu.Lock()
	rt.turn = nil
	cancelled := t.cancelled
	text := t.text.String()
	rt.mu.Unlock()
	var result, reason, summary string
	switch {
	case err != nil:
		f := asFailure(err, ReasonAgentError)
		result, reason, summary = runtimejsonl.ResultFailed, f.reason, f.detail
		if cancelled && f.reason == ReasonAgentError {
			result, reason = runtimejsonl.ResultCancelled, ""
		}
	default:
		result, reason = outcomeFor(res.StopReason)
		summary = "stopReason " + res.StopReason
	}
	if text != "" {
		r.event(rt, t.messageID, mapped{kind: runtimejsonl.KindMessage, text: clip(text, maxMessage)})
	}
	r.event(rt, t.messageID, mapped{kind: runtimejsonl.KindStatus, text: "idle"})
	r.outcome(rt, m.MessageID, result, reason, summary)
	r.postHistory(rt, m, t, text, result)
}

func (r *Runtime) outcome(rt *route, messageID, result, reason, summary string) {
	r.emit(runtimejsonl.Frame{Type: runtimejsonl.TypeOutcome, SessionID: rt.sessionID, Outcome: &runtimejsonl.Outcome{
		TurnID: "turn-" + messageID, RuntimeSessionID: rt.rsid, LastMessageID: messageID,
		Result: result, FailureReason: reason, Summary: clip(summary, 512), Time: time.Now().UTC(),
	}})
}

func (r *Runtime) event(rt *route, messageID string, ev mapped) {
	n := r.seq.Add(1)
	r.emit(runtimejsonl.Frame{Type: runtimejsonl.TypeEvent, SessionID: rt.sessionID, Event: &runtimejsonl.Event{
		EventID: fmt.Sprintf("%s-%s-%d", rt.rsid, r.prefix, n), RuntimeSessionID: rt.rsid, MessageID: messageID,
		Kind: ev.kind, Text: ev.text, ToolName: ev.tool, Data: ev.data, Time: time.Now().UTC(),
	}})
}

// abort cancels the route's running turn (session/cancel, open permission
// requests answered cancelled) or marks a queued message aborted.
func (r *Runtime) abort(rt *route, messageID string) {
	rt.mu.Lock()
	t := rt.turn
	if t == nil || (messageID != "" && messageID != t.messageID) {
		if messageID != "" {
			rt.aborted[messageID] = true
		}
		rt.mu.Unlock()
		return
	}
	t.cancelled = true
	perms := t.perms
	t.perms = map[string]*json.RawMessage{}
	rt.mu.Unlock()
	for _, id := range perms {
		_ = r.rpc.reply(id, map[string]any{"outcome": map[string]string{"outcome": "cancelled"}}, nil)
	}
	_ = r.rpc.notify("session/cancel", map[string]string{"sessionId": rt.acpID})
}

func (r *Runtime) closeRoute(id string) {
	r.mu.Lock()
	rt := r.routes[id]
	delete(r.routes, id)
	if rt != nil {
		delete(r.byACP, rt.acpID)
	}
	r.mu.Unlock()
	if rt == nil {
		return
	}
	rt.mu.Lock()
	rt.closed = true
	rt.mu.Unlock()
	r.abort(rt, "")
	close(rt.queue)
	if r.caps.SessionCapabilities.Close != nil {
		go func() { _ = r.call("session/close", map[string]string{"sessionId": rt.acpID}, 10*time.Second, nil) }()
	}
}

// dispatch handles the agent's notifications and requests.
func (r *Runtime) dispatch(m message) {
	switch m.Method {
	case "session/update":
		var n struct {
			SessionID string          `json:"sessionId"`
			Update    json.RawMessage `json:"update"`
		}
		if json.Unmarshal(m.Params, &n) != nil {
			return
		}
		r.onUpdate(n.SessionID, n.Update)
	case "session/request_permission":
		if m.ID != nil {
			r.onPermission(m)
		}
	default:
		if m.ID != nil {
			// fs/* and terminal/* were not offered; nothing else is ours.
			_ = r.rpc.reply(m.ID, nil, &rpcError{Code: -32601, Message: "method not supported by agentplane: " + clip(m.Method, 64)})
		}
	}
}

func (r *Runtime) onUpdate(acpID string, raw json.RawMessage) {
	r.mu.Lock()
	rt := r.byACP[acpID]
	r.mu.Unlock()
	if rt == nil {
		r.log.Debug("update for an unknown agent session")
		return
	}
	var u update
	if json.Unmarshal(raw, &u) != nil {
		return
	}
	if rt.loading.Load() {
		return // history replayed by session/load: already recorded
	}
	rt.mu.Lock()
	t := rt.turn
	messageID := ""
	var events []mapped
	if t != nil {
		messageID = t.messageID
		if u.SessionUpdate == updAgentChunk {
			t.text.WriteString(blockText(u.Content))
		}
		if u.SessionUpdate == updToolCall || u.SessionUpdate == updToolUpdate {
			t.record(u)
		}
	}
	events = mapUpdate(u, raw, rt.names)
	rt.mu.Unlock()
	for _, ev := range events {
		r.event(rt, messageID, ev)
	}
}

func (t *turn) record(u update) {
	rec := t.byTool[u.ToolCallID]
	if rec == nil {
		rec = &toolRecord{ID: u.ToolCallID}
		t.byTool[u.ToolCallID] = rec
		t.tools = append(t.tools, rec)
	}
	if rec.Title == "" {
		rec.Title = u.Title
	}
	if u.Kind != "" {
		rec.Kind = u.Kind
	}
	if u.Status != "" {
		rec.Status = u.Status
	}
	if in := bounded(u.RawInput); in != nil {
		rec.Input = in
	}
	if out := bounded(u.RawOutput); out != nil {
		rec.Output = out
	}
}

// onPermission answers session/request_permission with the route's policy:
// allow inside the sandbox, unless the tool's kind is rejected. Each
// decision is recorded as an event.
func (r *Runtime) onPermission(m message) {
	var p struct {
		SessionID string `json:"sessionId"`
		ToolCall  struct {
			ToolCallID string `json:"toolCallId"`
			Title      string `json:"title"`
			Kind       string `json:"kind"`
		} `json:"toolCall"`
		Options []struct {
			OptionID string `json:"optionId"`
			Kind     string `json:"kind"`
		} `json:"options"`
	}
	_ = json.Unmarshal(m.Params, &p)
	r.mu.Lock()
	rt := r.byACP[p.SessionID]
	r.mu.Unlock()
	if rt == nil {
		_ = r.rpc.reply(m.ID, map[string]any{"outcome": map[string]string{"outcome": "cancelled"}}, nil)
		return
	}
	rt.mu.Lock()
	t := rt.turn
	reject := slices.Contains(rt.reject, p.ToolCall.Kind)
	if t == nil || t.cancelled {
		rt.mu.Unlock()
		_ = r.rpc.reply(m.ID, map[string]any{"outcome": map[string]string{"outcome": "cancelled"}}, nil)
		return
	}
	rt.mu.Unlock()
	want := []string{"allow_once", "allow_always"}
	decision := "allowed"
	if reject {
		want, decision = []string{"reject_once", "reject_always"}, "rejected"
	}
	option := ""
	for _, k := range want {
		for _, o := range p.Options {
			if o.Kind == k && option == "" {
				option = o.OptionID
			}
		}
	}
	r.event(rt, t.messageID, mapped{kind: runtimejsonl.KindStatus, text: "permission " + decision, tool: p.ToolCall.Title,
		data: compact(map[string]any{"acp_update": "request_permission", "decision": decision, "tool_call_id": p.ToolCall.ToolCallID,
			"tool_kind": p.ToolCall.Kind, "option_id": option})})
	if option == "" {
		_ = r.rpc.reply(m.ID, map[string]any{"outcome": map[string]string{"outcome": "cancelled"}}, nil)
		return
	}
	_ = r.rpc.reply(m.ID, map[string]any{"outcome": map[string]string{"outcome": "selected", "optionId": option}}, nil)
}

// kill ends the agent's process group at once (a broken protocol or a
// failed start: nothing to wind down).
func (r *Runtime) kill() { _ = syscall.Kill(-r.pgid, syscall.SIGKILL) }

// Stop closes the agent's stdin, then terminates and kills its process
// group; it returns once the agent has exited.
func (r *Runtime) Stop() {
	r.once.Do(func() {
		r.mu.Lock()
		r.stopping = true
		r.mu.Unlock()
		_ = r.stdin.Close()
		select {
		case <-r.exited:
		case <-time.After(2 * time.Second):
			_ = syscall.Kill(-r.pgid, syscall.SIGTERM)
			select {
			case <-r.exited:
			case <-time.After(2 * time.Second):
			}
		}
		r.kill()
		<-r.exited
	})
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// sessionStore keeps agentplane session id → ACP session id under the
// sandbox home, so a restarted wrapper can session/load the conversation.
// It holds no secret.
type sessionStore struct {
	mu   sync.Mutex
	file string
}

func (s *sessionStore) read() map[string]string {
	m := map[string]string{}
	if b, err := os.ReadFile(s.file); err == nil {
		_ = json.Unmarshal(b, &m)
	}
	return m
}

func (s *sessionStore) get(sessionID string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.read()[sessionID]
}

func (s *sessionStore) put(sessionID, acpID string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.read()
	if m[sessionID] == acpID {
		return nil
	}
	m[sessionID] = acpID
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	tmp := s.file + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, s.file)
}
