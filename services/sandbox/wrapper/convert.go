package wrapper

import (
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
)

var eventKinds = map[string]runtimev1.RuntimeEventKind{
	runtimejsonl.KindProgress:     runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_PROGRESS,
	runtimejsonl.KindMessageDelta: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA,
	runtimejsonl.KindMessage:      runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE,
	runtimejsonl.KindToolCall:     runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL,
	runtimejsonl.KindToolResult:   runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT,
	runtimejsonl.KindStatus:       runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_STATUS,
}

var turnResults = map[string]runtimev1.TurnResult{
	runtimejsonl.ResultSucceeded: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED,
	runtimejsonl.ResultFailed:    runtimev1.TurnResult_TURN_RESULT_FAILED,
	runtimejsonl.ResultCancelled: runtimev1.TurnResult_TURN_RESULT_CANCELLED,
}

// EventToProto converts a runtime event; an unknown kind yields none (the
// receivers reject UNSPECIFIED anyway).
func EventToProto(e *runtimejsonl.Event) []*runtimev1.RuntimeEvent {
	kind, ok := eventKinds[e.Kind]
	if !ok {
		return nil
	}
	out := &runtimev1.RuntimeEvent{
		EventId: e.EventID, RuntimeSessionId: e.RuntimeSessionID, MessageId: e.MessageID, Kind: kind,
		Text: e.Text, ToolName: e.ToolName, Time: timestamppb.New(e.Time),
	}
	if len(e.Data) > 0 {
		if s, err := structpb.NewStruct(e.Data); err == nil && len(e.Data) > 0 {
			out.Data = s
		}
	}
	return []*runtimev1.RuntimeEvent{out}
}

// OutcomeToProto converts a turn outcome; an unknown result becomes FAILED
// (runtime_protocol_error) so the turn still settles exactly once.
func OutcomeToProto(o *runtimejsonl.Outcome) *runtimev1.TurnOutcome {
	res, ok := turnResults[o.Result]
	reason := o.FailureReason
	if !ok {
		res, reason = runtimev1.TurnResult_TURN_RESULT_FAILED, "runtime_protocol_error"
	}
	return &runtimev1.TurnOutcome{
		TurnId: o.TurnID, RuntimeSessionId: o.RuntimeSessionID, LastMessageId: o.LastMessageID, Result: res,
		FailureReason: reason, Summary: o.Summary, Time: timestamppb.New(o.Time),
	}
}

func progressStep(step, detail string) *runtimev1.ProgressStep {
	return &runtimev1.ProgressStep{Step: step, Detail: detail, Time: timestamppb.Now()}
}
