package driver

import "time"

// Notifier is the session service as the driver reports to it: route
// changes, runtime events and turn outcomes, sent in the order raised and
// retried by the implementation (internal/edge/notify adapts
// SessionNotifyService to it). Calls never block on the network.
type Notifier interface {
	Progress(ref RouteRef, step ProgressStep)
	Ready(ref RouteRef, runtimeSessionID, instance string)
	Reconnecting(ref RouteRef)
	Failed(ref RouteRef, reason string, retryable bool)
	Lost(ref RouteRef, reason string)
	Events(ref RouteRef, events []RuntimeEvent)
	Outcome(ref RouteRef, outcome TurnOutcome)
}

// RouteRef identifies the route a notification is about, under the owner's
// fence.
type RouteRef struct {
	SessionID, SandboxID, AllocationID string
	FenceToken                         uint64
}

// ProgressStep is one preparation step of a route.
type ProgressStep struct {
	Step, Detail string
	Time         time.Time
}

func progressStep(step, detail string) ProgressStep {
	return ProgressStep{Step: step, Detail: detail, Time: time.Now()}
}

// EventKind is what a runtime event reports.
type EventKind string

// Runtime event kinds ("" is unspecified).
const (
	EventProgress     EventKind = "progress"
	EventMessageDelta EventKind = "message_delta"
	EventMessage      EventKind = "message"
	EventToolCall     EventKind = "tool_call"
	EventToolResult   EventKind = "tool_result"
	EventStatus       EventKind = "status"
	EventEgress       EventKind = "egress"
)

// RuntimeEvent is one event of a runtime session; the driver relays it
// unread.
type RuntimeEvent struct {
	ID, RuntimeSessionID, MessageID string
	Kind                            EventKind
	Text, ToolName                  string
	Data                            map[string]any // JSON object; nil: none
	Time                            time.Time
}

// TurnResult is how a turn ended.
type TurnResult string

// Turn results ("" is unspecified).
const (
	TurnSucceeded TurnResult = "succeeded"
	TurnFailed    TurnResult = "failed"
	TurnCancelled TurnResult = "cancelled"
)

// TurnOutcome settles the accepted messages of a session up to and
// including LastMessageID.
type TurnOutcome struct {
	TurnID, RuntimeSessionID, LastMessageID string
	Result                                  TurnResult
	FailureReason, Summary                  string
	Time                                    time.Time
}
