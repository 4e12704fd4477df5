// Package runtimejsonl is the JSON-lines stdio protocol between the wrapper
// and the agent runtime it supervises (docs/runtime-protocol.md). One Frame
// per line; Type says which fields apply. Handles travel on the runtime's
// stdin only (open_route, credentials), never in its environment or argv.
package runtimejsonl

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"
)

// Frame types, wrapper → runtime.
const (
	TypeOpenRoute   = "open_route"
	TypeMessage     = "message"
	TypeAbort       = "abort"
	TypeCloseRoute  = "close_route"
	TypeCredentials = "credentials"
	TypeShutdown    = "shutdown"
)

// Frame types, runtime → wrapper.
const (
	TypeRouteReady  = "route_ready"
	TypeRouteFailed = "route_failed"
	TypeProgress    = "progress"
	TypeEvent       = "event"
	TypeOutcome     = "outcome"
)

// MaxLine bounds one frame (events carry at most 64 KiB of data plus text).
const MaxLine = 1 << 20

// Frame is one line of the protocol.
type Frame struct {
	Type      string `json:"type"`
	SessionID string `json:"session_id,omitempty"`

	// open_route
	Directory        string `json:"directory,omitempty"`
	Handle           string `json:"handle,omitempty"` // secret: stdin only
	ProxyURL         string `json:"proxy_url,omitempty"`
	RuntimeSessionID string `json:"runtime_session_id,omitempty"`
	// Agent is the profile the route asks for; RejectToolKinds its
	// permission policy (ACP runtimes; the scripted runtime ignores both).
	Agent           string   `json:"agent,omitempty"`
	RejectToolKinds []string `json:"reject_tool_kinds,omitempty"`

	// message, abort
	MessageID string `json:"message_id,omitempty"`
	Content   string `json:"content,omitempty"`
	// Traceparent is the W3C trace context of the delivery (message frames);
	// a runtime sends it on its proxy requests so the trace continues.
	Traceparent string `json:"traceparent,omitempty"`

	// credentials
	SessionIDs []string `json:"session_ids,omitempty"`

	// route_failed, progress
	Reason    string `json:"reason,omitempty"`
	Detail    string `json:"detail,omitempty"`
	Retryable bool   `json:"retryable,omitempty"`
	Step      string `json:"step,omitempty"`

	Event   *Event   `json:"event,omitempty"`
	Outcome *Outcome `json:"outcome,omitempty"`
}

// Event mirrors agentplane.runtime.v1.RuntimeEvent; Kind is lower snake
// (progress, message_delta, message, tool_call, tool_result, status).
type Event struct {
	EventID          string         `json:"event_id"`
	RuntimeSessionID string         `json:"runtime_session_id"`
	MessageID        string         `json:"message_id,omitempty"`
	Kind             string         `json:"kind"`
	Text             string         `json:"text,omitempty"`
	ToolName         string         `json:"tool_name,omitempty"`
	Data             map[string]any `json:"data,omitempty"`
	Time             time.Time      `json:"time"`
}

// Outcome mirrors agentplane.runtime.v1.TurnOutcome; Result is succeeded,
// failed or cancelled.
type Outcome struct {
	TurnID           string    `json:"turn_id"`
	RuntimeSessionID string    `json:"runtime_session_id"`
	LastMessageID    string    `json:"last_message_id"`
	Result           string    `json:"result"`
	FailureReason    string    `json:"failure_reason,omitempty"`
	Summary          string    `json:"summary,omitempty"`
	Time             time.Time `json:"time"`
}

// Event kinds and turn results.
const (
	KindProgress     = "progress"
	KindMessageDelta = "message_delta"
	KindMessage      = "message"
	KindToolCall     = "tool_call"
	KindToolResult   = "tool_result"
	KindStatus       = "status"

	ResultSucceeded = "succeeded"
	ResultFailed    = "failed"
	ResultCancelled = "cancelled"
)

// ErrBadFrame reports a line that is not a valid frame.
var ErrBadFrame = errors.New("runtimejsonl: bad frame")

// Parse decodes one line. It checks only the shape every receiver relies on:
// a known type and a session id where the type needs one.
func Parse(line []byte) (Frame, error) {
	var f Frame
	if err := json.Unmarshal(line, &f); err != nil {
		return Frame{}, fmt.Errorf("%w: %w", ErrBadFrame, err)
	}
	switch f.Type {
	case TypeShutdown, TypeCredentials:
	case TypeOpenRoute, TypeMessage, TypeAbort, TypeCloseRoute,
		TypeRouteReady, TypeRouteFailed, TypeProgress:
		if f.SessionID == "" {
			return Frame{}, fmt.Errorf("%w: %s without session_id", ErrBadFrame, f.Type)
		}
	case TypeEvent:
		if f.SessionID == "" || f.Event == nil || f.Event.Kind == "" {
			return Frame{}, fmt.Errorf("%w: event without session_id or kind", ErrBadFrame)
		}
	case TypeOutcome:
		if f.SessionID == "" || f.Outcome == nil || f.Outcome.Result == "" {
			return Frame{}, fmt.Errorf("%w: outcome without session_id or result", ErrBadFrame)
		}
	default:
		return Frame{}, fmt.Errorf("%w: unknown type %q", ErrBadFrame, f.Type)
	}
	return f, nil
}

// Writer writes frames as lines; safe for concurrent use.
type Writer struct {
	mu sync.Mutex
	w  io.Writer
}

// NewWriter writes to w.
func NewWriter(w io.Writer) *Writer { return &Writer{w: w} }

// Write encodes f as one line.
func (w *Writer) Write(f Frame) error {
	b, err := json.Marshal(f)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	w.mu.Lock()
	defer w.mu.Unlock()
	_, err = w.w.Write(b)
	return err
}

// NewScanner reads lines of up to MaxLine bytes.
func NewScanner(r io.Reader) *bufio.Scanner {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 64<<10), MaxLine)
	return s
}
