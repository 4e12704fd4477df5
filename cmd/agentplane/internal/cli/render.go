package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"charm.land/lipgloss/v2"
	"github.com/charmbracelet/colorprofile"
	"github.com/charmbracelet/x/ansi"
	"github.com/charmbracelet/x/term"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// renderer shows a session's events: for people or for scripts.
type renderer interface {
	// Header introduces the session being followed.
	Header(s *sessionv1.Session)
	// Event shows one event.
	Event(ev *sessionv1.SessionEvent)
	// Close ends the output (stops the progress line).
	Close()
}

func newRenderer(output string, stdout io.Writer, start time.Time) renderer {
	if output == "json" {
		return &jsonRenderer{w: stdout}
	}
	return newHuman(stdout, start)
}

// jsonRenderer writes each event as one line of protojson.
type jsonRenderer struct{ w io.Writer }

func (*jsonRenderer) Header(*sessionv1.Session) {}
func (*jsonRenderer) Close()                    {}
func (j *jsonRenderer) Event(ev *sessionv1.SessionEvent) {
	writeJSON(j.w, ev)
}

func writeJSON(w io.Writer, m proto.Message) {
	b, err := protojson.Marshal(m)
	if err != nil { // only for invalid UTF-8, which the server never sends
		b, _ = json.Marshal(map[string]string{"error": err.Error()})
	}
	fmt.Fprintf(w, "%s\n", b)
}

// human writes for a person. On a terminal, preparation and work in
// progress are one line rewritten in place with the elapsed time, and
// outcomes are coloured; elsewhere every line is plain text, written once.
type human struct {
	mu          sync.Mutex
	w           io.Writer
	tty         bool
	width       func() int
	start       time.Time
	progress    string // the current progress note; "" when no progress line is shown
	midLine     bool   // streamed reply text without its newline yet
	streamed    bool   // reply deltas were shown for the current message
	stop        chan struct{}
	done        sync.WaitGroup
	routeFailed bool // a failed route was shown
	// Tool calls still running, by toolKey, in the order they began.
	tools     map[string]*toolCall
	toolOrder []string

	dim, bold, ok, bad, warn lipgloss.Style
}

func newHuman(stdout io.Writer, start time.Time) *human {
	h := &human{w: stdout, start: start, width: func() int { return 0 }}
	if f, ok := stdout.(*os.File); ok && term.IsTerminal(f.Fd()) {
		h.tty = true
		// colorprofile drops colours the terminal (or NO_COLOR) does not take.
		h.w = colorprofile.NewWriter(f, os.Environ())
		h.width = func() int {
			w, _, err := term.GetSize(f.Fd())
			if err != nil {
				return 0
			}
			return w
		}
		h.dim = lipgloss.NewStyle().Faint(true)
		h.bold = lipgloss.NewStyle().Bold(true)
		h.ok = lipgloss.NewStyle().Foreground(lipgloss.Green).Bold(true)
		h.bad = lipgloss.NewStyle().Foreground(lipgloss.Red).Bold(true)
		h.warn = lipgloss.NewStyle().Foreground(lipgloss.Yellow)
		h.stop = make(chan struct{})
		h.done.Add(1)
		go h.tick()
	}
	return h
}

// tick redraws the progress line so its elapsed time keeps moving.
func (h *human) tick() {
	defer h.done.Done()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-h.stop:
			return
		case <-t.C:
			h.mu.Lock()
			if h.progress != "" {
				h.drawProgress()
			}
			h.mu.Unlock()
		}
	}
}

var spinner = []string{"⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"}

func (h *human) elapsed() string {
	return fmt.Sprintf("%.1fs", time.Since(h.start).Seconds())
}

// drawProgress rewrites the terminal's current line (h.mu held).
func (h *human) drawProgress() {
	frame := spinner[int(time.Since(h.start)/(100*time.Millisecond))%len(spinner)]
	line := fmt.Sprintf("%s %s %s", frame, h.progress, h.dim.Render("("+h.elapsed()+")"))
	if w := h.width(); w > 1 {
		line = ansi.Truncate(line, w-1, "…")
	}
	fmt.Fprint(h.w, "\r"+ansi.EraseEntireLine+line)
}

// setProgress shows note as the progress line: in place on a terminal,
// as a line of its own elsewhere.
func (h *human) setProgress(note string) {
	if !h.tty {
		h.endText()
		fmt.Fprintf(h.w, "%s (%s)\n", note, h.elapsed())
		return
	}
	if h.midLine {
		return // never break streamed text with a progress line
	}
	h.progress = note
	h.drawProgress()
}

// clearProgress removes the progress line before other output.
func (h *human) clearProgress() {
	if h.tty && h.progress != "" {
		fmt.Fprint(h.w, "\r"+ansi.EraseEntireLine)
		h.progress = ""
	}
}

// endText ends streamed text with its newline.
func (h *human) endText() {
	if h.midLine {
		fmt.Fprintln(h.w)
		h.midLine = false
	}
}

// line writes one line of its own.
func (h *human) line(s string) {
	h.clearProgress()
	h.endText()
	fmt.Fprintln(h.w, s)
}

func (h *human) Header(s *sessionv1.Session) {
	h.mu.Lock()
	defer h.mu.Unlock()
	where := s.GetWorktree().GetDirectory()
	if u := s.GetWorktree().GetRepoUrl(); u != "" {
		where += " (" + u + ")"
	}
	h.line(h.dim.Render(fmt.Sprintf("session %s · %s · sandbox %s", s.GetSessionId(), where, s.GetSandboxId())))
}

func (h *human) Close() {
	if h.stop != nil {
		close(h.stop)
		h.done.Wait()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.flushTools()
	h.clearProgress()
	h.endText()
}

func (h *human) Event(ev *sessionv1.SessionEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch k := ev.GetKind().(type) {
	case *sessionv1.SessionEvent_Progress:
		note := "preparing: " + k.Progress.GetStep()
		if d := k.Progress.GetDetail(); d != "" {
			note += " — " + d
		}
		h.setProgress(note)
	case *sessionv1.SessionEvent_Route:
		h.route(k.Route)
	case *sessionv1.SessionEvent_Message:
		h.message(k.Message)
	case *sessionv1.SessionEvent_RuntimeEvent:
		h.runtime(k.RuntimeEvent)
	case *sessionv1.SessionEvent_Outcome:
		h.outcome(k.Outcome)
	case *sessionv1.SessionEvent_Session:
		if st := k.Session.GetState(); st != sessionv1.SessionState_SESSION_STATE_ACTIVE {
			h.line(h.warn.Render("session " + enumName(st.String(), "SESSION_STATE_")))
		}
	}
}

func (h *human) route(r *sessionv1.RouteView) {
	switch r.GetState() {
	case sessionv1.RouteState_ROUTE_STATE_PREPARING:
		// Each step is also reported as a ProgressStep, with its detail:
		// plain output shows that one, a terminal both (in place).
		if h.tty {
			h.setProgress("preparing: " + r.GetStep())
		}
	case sessionv1.RouteState_ROUTE_STATE_READY:
		h.line(h.dim.Render("ready after " + h.elapsed()))
		h.setProgress("working")
	case sessionv1.RouteState_ROUTE_STATE_RECONNECTING:
		h.setProgress("reconnecting to the agent")
	case sessionv1.RouteState_ROUTE_STATE_FAILED:
		h.routeFailed = true
		h.line(h.bad.Render("✗ preparation failed: "+r.GetFailureReason()) + routeHint(r.GetFailureReason()))
	case sessionv1.RouteState_ROUTE_STATE_SUSPENDED:
		h.line(h.dim.Render("suspended: the agent stopped; the next message resumes it"))
	}
}

// RouteFailure shows why the route failed when the stream has not (the
// message that failed route_failed comes before the route's own event,
// which a run does not wait for): r is the session's route as GetSession
// reads it.
func (h *human) RouteFailure(r *sessionv1.RouteView) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.routeFailed && r.GetState() == sessionv1.RouteState_ROUTE_STATE_FAILED {
		h.route(r)
	}
}

// routeHint says what a person can do about a route failure the CLI's own
// flags cause ("" for the others).
func routeHint(reason string) string {
	switch reason {
	case "repo_auth_failed":
		return " (the git token was refused, or the repository wants one: --git-token-file or AGENTPLANE_GIT_TOKEN)"
	case "repo_unreachable":
		return " (no such repository, or its host does not answer: check --repo)"
	}
	return ""
}

func (h *human) message(m *sessionv1.Message) {
	switch m.GetState() {
	case sessionv1.MessageState_MESSAGE_STATE_QUEUED:
		h.setProgress("queued " + m.GetMessageId())
	case sessionv1.MessageState_MESSAGE_STATE_FAILED:
		h.line(h.bad.Render(fmt.Sprintf("✗ message %s failed: %s", m.GetMessageId(), m.GetFailureReason())))
	case sessionv1.MessageState_MESSAGE_STATE_CANCELLED:
		h.line(h.warn.Render(fmt.Sprintf("■ message %s cancelled", m.GetMessageId())))
	}
}

func (h *human) runtime(e *runtimev1.RuntimeEvent) {
	switch e.GetKind() {
	case runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_PROGRESS:
		h.setProgress(e.GetText())
	case runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA:
		h.clearProgress()
		fmt.Fprint(h.w, e.GetText())
		h.midLine = !strings.HasSuffix(e.GetText(), "\n")
		h.streamed = true
	case runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE:
		if h.streamed { // the deltas showed it already
			h.endText()
			h.streamed = false
			return
		}
		h.line(e.GetText())
	case runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL, runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT:
		h.tool(e)
	}
}

func (h *human) outcome(o *runtimev1.TurnOutcome) {
	h.flushTools()
	summary := o.GetSummary()
	if summary != "" {
		summary = " — " + summary
	}
	if u := o.GetUsage(); u.GetRequests() > 0 {
		summary += " · " + usageText(u)
	}
	switch o.GetResult() {
	case runtimev1.TurnResult_TURN_RESULT_SUCCEEDED:
		h.line(h.ok.Render("✓ succeeded") + summary + h.dim.Render(" ("+h.elapsed()+")"))
	case runtimev1.TurnResult_TURN_RESULT_FAILED:
		h.line(h.bad.Render("✗ failed: "+o.GetFailureReason()) + summary + h.dim.Render(" ("+h.elapsed()+")"))
	default:
		h.line(h.warn.Render("■ cancelled") + summary + h.dim.Render(" ("+h.elapsed()+")"))
	}
}

// enumName is an enum value's name without its prefix, in lower case.
func enumName(name, prefix string) string {
	return strings.ToLower(strings.TrimPrefix(name, prefix))
}
