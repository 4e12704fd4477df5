package wrapper

import (
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	"agentplane.dev/services/sandbox/internal/runtimeproto"
)

var eventKinds = map[string]runtimev1.RuntimeEventKind{
	runtimeproto.KindProgress:     runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_PROGRESS,
	runtimeproto.KindMessageDelta: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA,
	runtimeproto.KindMessage:      runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE,
	runtimeproto.KindToolCall:     runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL,
	runtimeproto.KindToolResult:   runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT,
	runtimeproto.KindStatus:       runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_STATUS,
}

var turnResults = map[string]runtimev1.TurnResult{
	runtimeproto.ResultSucceeded: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED,
	runtimeproto.ResultFailed:    runtimev1.TurnResult_TURN_RESULT_FAILED,
	runtimeproto.ResultCancelled: runtimev1.TurnResult_TURN_RESULT_CANCELLED,
}

// EventToProto converts a runtime event; an unknown kind yields none (the
// receivers reject UNSPECIFIED anyway).
func EventToProto(e *runtimeproto.Event) []*runtimev1.RuntimeEvent {
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
func OutcomeToProto(o *runtimeproto.Outcome) *runtimev1.TurnOutcome {
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
