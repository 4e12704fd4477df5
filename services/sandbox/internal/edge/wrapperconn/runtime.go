package wrapperconn

import (
	"time"

	"agentplane.dev/pkg/gitrepo"

	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	"agentplane.dev/services/sandbox/internal/control/driver"
)

// The runtime's reports (runtimev1) that wrapper frames carry, both ways:
// from the wire into the driver, and back onto the wire for the session
// service (internal/edge/notify) and SandboxService (grpcapi). A round trip
// keeps every field, a missing time and missing data included.

var eventKinds = map[runtimev1.RuntimeEventKind]driver.EventKind{
	runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_PROGRESS:      driver.EventProgress,
	runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA: driver.EventMessageDelta,
	runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE:       driver.EventMessage,
	runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL:     driver.EventToolCall,
	runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT:   driver.EventToolResult,
	runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_STATUS:        driver.EventStatus,
	runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_EGRESS:        driver.EventEgress,
}

var turnResults = map[runtimev1.TurnResult]driver.TurnResult{
	runtimev1.TurnResult_TURN_RESULT_SUCCEEDED: driver.TurnSucceeded,
	runtimev1.TurnResult_TURN_RESULT_FAILED:    driver.TurnFailed,
	runtimev1.TurnResult_TURN_RESULT_CANCELLED: driver.TurnCancelled,
}

var fileChangeKinds = map[runtimev1.FileChangeKind]gitrepo.FileChangeKind{
	runtimev1.FileChangeKind_FILE_CHANGE_KIND_ADDED:    gitrepo.FileAdded,
	runtimev1.FileChangeKind_FILE_CHANGE_KIND_MODIFIED: gitrepo.FileModified,
	runtimev1.FileChangeKind_FILE_CHANGE_KIND_DELETED:  gitrepo.FileDeleted,
}

// The reverse tables (an unknown domain value is UNSPECIFIED).
var (
	eventKindProtos      = invert(eventKinds)
	turnResultProtos     = invert(turnResults)
	fileChangeKindProtos = invert(fileChangeKinds)
)

func invert[K, V comparable](m map[K]V) map[V]K {
	out := make(map[V]K, len(m))
	for k, v := range m {
		out[v] = k
	}
	return out
}

func timeOf(t *timestamppb.Timestamp) time.Time {
	if t == nil {
		return time.Time{}
	}
	return t.AsTime()
}

func timeProto(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func progress(p *runtimev1.ProgressStep) driver.ProgressStep {
	return driver.ProgressStep{Step: p.GetStep(), Detail: p.GetDetail(), Time: timeOf(p.GetTime())}
}

// ProgressProto is a preparation step on the wire.
func ProgressProto(p driver.ProgressStep) *runtimev1.ProgressStep {
	return &runtimev1.ProgressStep{Step: p.Step, Detail: p.Detail, Time: timeProto(p.Time)}
}

func events(pbs []*runtimev1.RuntimeEvent) []driver.RuntimeEvent {
	out := make([]driver.RuntimeEvent, 0, len(pbs))
	for _, e := range pbs {
		var data map[string]any
		if e.GetData() != nil {
			data = e.GetData().AsMap()
		}
		out = append(out, driver.RuntimeEvent{
			ID: e.GetEventId(), RuntimeSessionID: e.GetRuntimeSessionId(), MessageID: e.GetMessageId(),
			Kind: eventKinds[e.GetKind()], Text: e.GetText(), ToolName: e.GetToolName(), Data: data, Time: timeOf(e.GetTime()),
		})
	}
	return out
}

// EventsProto is runtime events on the wire. Data that is not a JSON
// object of JSON values (never from the wire) is left out.
func EventsProto(evs []driver.RuntimeEvent) []*runtimev1.RuntimeEvent {
	out := make([]*runtimev1.RuntimeEvent, 0, len(evs))
	for _, e := range evs {
		var data *structpb.Struct
		if e.Data != nil {
			data, _ = structpb.NewStruct(e.Data)
		}
		out = append(out, &runtimev1.RuntimeEvent{
			EventId: e.ID, RuntimeSessionId: e.RuntimeSessionID, MessageId: e.MessageID,
			Kind: eventKindProtos[e.Kind], Text: e.Text, ToolName: e.ToolName, Data: data, Time: timeProto(e.Time),
		})
	}
	return out
}

func outcome(o *runtimev1.TurnOutcome) driver.TurnOutcome {
	return driver.TurnOutcome{
		TurnID: o.GetTurnId(), RuntimeSessionID: o.GetRuntimeSessionId(), LastMessageID: o.GetLastMessageId(),
		Result: turnResults[o.GetResult()], FailureReason: o.GetFailureReason(), Summary: o.GetSummary(), Time: timeOf(o.GetTime()),
	}
}

// OutcomeProto is a turn outcome on the wire.
func OutcomeProto(o driver.TurnOutcome) *runtimev1.TurnOutcome {
	return &runtimev1.TurnOutcome{
		TurnId: o.TurnID, RuntimeSessionId: o.RuntimeSessionID, LastMessageId: o.LastMessageID,
		Result: turnResultProtos[o.Result], FailureReason: o.FailureReason, Summary: o.Summary, Time: timeProto(o.Time),
	}
}

func worktreeChanges(c *runtimev1.WorktreeChanges) gitrepo.Changes {
	files := make([]gitrepo.FileChange, 0, len(c.GetFiles()))
	for _, f := range c.GetFiles() {
		files = append(files, gitrepo.FileChange{Path: f.GetPath(), Kind: fileChangeKinds[f.GetKind()]})
	}
	return gitrepo.Changes{Files: files, Diff: c.GetDiff(), DiffTruncated: c.GetDiffTruncated(), HeadCommit: c.GetHeadCommit(), Time: timeOf(c.GetTime())}
}

var fileTypes = map[runtimev1.WorktreeFileType]driver.FileType{
	runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_FILE:      driver.FileRegular,
	runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_DIRECTORY: driver.FileDirectory,
	runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_SYMLINK:   driver.FileSymlink,
	runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_OTHER:     driver.FileOther,
}

func worktreeFiles(fs []*runtimev1.WorktreeFile) []driver.WorktreeFile {
	if len(fs) == 0 {
		return nil
	}
	out := make([]driver.WorktreeFile, 0, len(fs))
	for _, f := range fs {
		t, ok := fileTypes[f.GetType()]
		if !ok {
			t = driver.FileOther
		}
		out = append(out, driver.WorktreeFile{Name: f.GetName(), Type: t, Size: f.GetSize(), Mode: f.GetMode()})
	}
	return out
}

// WorktreeFilesProto is a page of worktree entries on the wire.
func WorktreeFilesProto(fs []driver.WorktreeFile) []*runtimev1.WorktreeFile {
	out := make([]*runtimev1.WorktreeFile, 0, len(fs))
	for _, f := range fs {
		t := runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_OTHER
		for k, v := range fileTypes {
			if v == f.Type {
				t = k
			}
		}
		out = append(out, &runtimev1.WorktreeFile{Name: f.Name, Type: t, Size: f.Size, Mode: f.Mode})
	}
	return out
}

// WorktreeChangesProto is a worktree's change set on the wire.
func WorktreeChangesProto(c gitrepo.Changes) *runtimev1.WorktreeChanges {
	files := make([]*runtimev1.FileChange, 0, len(c.Files))
	for _, f := range c.Files {
		files = append(files, &runtimev1.FileChange{Path: f.Path, Kind: fileChangeKindProtos[f.Kind]})
	}
	return &runtimev1.WorktreeChanges{Files: files, Diff: c.Diff, DiffTruncated: c.DiffTruncated, HeadCommit: c.HeadCommit, Time: timeProto(c.Time)}
}
