package wrapperconn

import (
	"testing"
	"time"

	"agentplane.dev/pkg/gitrepo"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
)

func requireProto(t *testing.T, want, got proto.Message) {
	t.Helper()
	require.True(t, proto.Equal(want, got), "want %v\ngot  %v", want, got)
}

// Every frame the driver sends has the wire form the wrapper reads.
func TestResponseWireForms(t *testing.T) {
	cases := []struct {
		frame driver.ToWrapper
		want  *sandboxv1.ConnectResponse
	}{
		{driver.HelloAck{Heartbeat: time.Second, ReconnectWindow: time.Minute, Contract: scope.Worktree},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_HelloAck{HelloAck: &sandboxv1.HelloAck{
				HeartbeatInterval: durationpb.New(time.Second), ReconnectWindow: durationpb.New(time.Minute),
				Contract: sandboxv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE}}}},
		{driver.PrepareRoute{SessionID: "s1", Directory: "/repo", RepoURL: "https://git/r", Handle: "h1", ProxyURL: "http://p/s/sb",
			Contract: scope.PerSession, RuntimeSessionID: "rs1", Agent: store.Agent{Profile: "opencode", Model: "m", RejectToolKinds: []string{"exec"}},
			RepoRef: "main", RepoDepth: 1, CloneRepo: true, Traceparent: "00-tp"},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_PrepareRoute{PrepareRoute: &sandboxv1.PrepareRoute{
				SessionId: "s1", Directory: "/repo", RepoUrl: "https://git/r", Handle: "h1", ProxyUrl: "http://p/s/sb",
				Contract: sandboxv1.RuntimeContract_RUNTIME_CONTRACT_PER_SESSION, RuntimeSessionId: "rs1",
				Agent:   &sandboxv1.Agent{Profile: "opencode", Model: "m", RejectToolKinds: []string{"exec"}},
				RepoRef: "main", RepoDepth: 1, CloneRepo: true, Traceparent: "00-tp"}}}},
		{driver.Delivery{SessionID: "s1", Messages: []driver.Message{{ID: "m1", Content: "hi"}}, Traceparent: "00-tp"},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Deliver{Deliver: &sandboxv1.Deliver{
				SessionId: "s1", Messages: []*sandboxv1.DeliveryMessage{{MessageId: "m1", Content: "hi"}}, Traceparent: "00-tp"}}}},
		{driver.Abort{SessionID: "s1", MessageID: "m1"},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Abort{Abort: &sandboxv1.Abort{SessionId: "s1", MessageId: "m1"}}}},
		{driver.HandleUpdate{SessionIDs: []string{"s1", "s2"}, Handle: "h2"},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Credentials{Credentials: &sandboxv1.Credentials{SessionIds: []string{"s1", "s2"}, Handle: "h2"}}}},
		{driver.Shutdown{Reason: driver.StaleFence, Detail: "stale"},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Shutdown{Shutdown: &sandboxv1.Shutdown{
				Reason: sandboxv1.ShutdownReason_SHUTDOWN_REASON_STALE_FENCE, Detail: "stale"}}}},
		{driver.ReleaseRoute{SessionID: "s1"},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_ReleaseRoute{ReleaseRoute: &sandboxv1.ReleaseRoute{SessionId: "s1"}}}},
		{driver.WorktreeRequest{RequestID: "wt1", SessionID: "s1"},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_WorktreeRequest{WorktreeRequest: &sandboxv1.WorktreeRequest{
				RequestId: "wt1", SessionId: "s1", Action: &sandboxv1.WorktreeRequest_Changes{Changes: &sandboxv1.WorktreeChangesAction{}}}}}},
		{driver.WorktreeRequest{RequestID: "wt2", SessionID: "s1", Push: &driver.WorktreePush{Branch: "b", CommitMessage: "c"}},
			&sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_WorktreeRequest{WorktreeRequest: &sandboxv1.WorktreeRequest{
				RequestId: "wt2", SessionId: "s1", Action: &sandboxv1.WorktreeRequest_Push{Push: &sandboxv1.WorktreePushAction{Branch: "b", CommitMessage: "c"}}}}}},
	}
	for _, c := range cases {
		requireProto(t, c.want, Response(c.frame))
	}
	for reason, want := range map[driver.ShutdownReason]sandboxv1.ShutdownReason{
		driver.StaleAllocation: sandboxv1.ShutdownReason_SHUTDOWN_REASON_STALE_ALLOCATION,
		driver.BadCredential:   sandboxv1.ShutdownReason_SHUTDOWN_REASON_BAD_CREDENTIAL,
		driver.LeaseLost:       sandboxv1.ShutdownReason_SHUTDOWN_REASON_LEASE_LOST,
		driver.StopRequested:   sandboxv1.ShutdownReason_SHUTDOWN_REASON_STOP_REQUESTED,
	} {
		require.Equal(t, want, Response(driver.Shutdown{Reason: reason}).GetShutdown().GetReason(), reason)
	}
}

// Every frame a wrapper sends reaches the driver with its fields; a frame
// this service does not know is nil.
func TestRequestDomainForms(t *testing.T) {
	cases := []struct {
		frame *sandboxv1.ConnectRequest
		want  driver.FromWrapper
	}{
		{&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Hello{Hello: &sandboxv1.Hello{
			SandboxId: "sb", AllocationId: "a", RuntimeKey: "/repo", InstanceId: "wi", Generation: 2, FenceToken: 7,
			LaunchCredential: "aplc_x", Capabilities: []string{"worktree"}, ProtocolVersion: 1,
			Routes: []*sandboxv1.ActiveRoute{{SessionId: "s1", RuntimeSessionId: "rs1"}}}}},
			driver.Hello{SandboxID: "sb", AllocationID: "a", RuntimeKey: "/repo", InstanceID: "wi", Generation: 2, FenceToken: 7,
				LaunchCredential: "aplc_x", Capabilities: []string{"worktree"}, ProtocolVersion: 1,
				Routes: []driver.ActiveRoute{{SessionID: "s1", RuntimeSessionID: "rs1"}}}},
		{&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Heartbeat{Heartbeat: &sandboxv1.Heartbeat{BusySessionIds: []string{"s1"}}}},
			driver.Heartbeat{BusySessionIDs: []string{"s1"}}},
		{&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Progress{Progress: &sandboxv1.RouteProgress{
			SessionId: "s1", Progress: &runtimev1.ProgressStep{Step: "clone", Detail: "d", Time: timestamppb.New(time.Unix(5, 0))}}}},
			driver.Progress{SessionID: "s1", Step: driver.ProgressStep{Step: "clone", Detail: "d", Time: time.Unix(5, 0).UTC()}}},
		{&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_RouteReady{RouteReady: &sandboxv1.RouteReady{SessionId: "s1", RuntimeSessionId: "rs1"}}},
			driver.RouteReady{SessionID: "s1", RuntimeSessionID: "rs1"}},
		{&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_RouteFailed{RouteFailed: &sandboxv1.RouteFailed{SessionId: "s1", Reason: "clone_failed", Retryable: true}}},
			driver.RouteFailed{SessionID: "s1", Reason: "clone_failed", Retryable: true}},
		{&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_WorktreeResult{WorktreeResult: &sandboxv1.WorktreeResult{
			RequestId: "wt1", CommitId: "c", Ref: "refs/heads/b", Committed: true, ErrorReason: "PUSH_REJECTED", ErrorDetail: "d"}}},
			driver.WorktreeResult{RequestID: "wt1", CommitID: "c", Ref: "refs/heads/b", Committed: true, ErrorReason: "PUSH_REJECTED", ErrorDetail: "d"}},
		{&sandboxv1.ConnectRequest{}, nil},
	}
	for _, c := range cases {
		require.Equal(t, c.want, Request(c.frame))
	}
}

// The runtime's reports survive the trip through the driver unchanged:
// wire → domain → wire is the identity, data, missing data and missing
// times included.
func TestRuntimeReportsRoundTrip(t *testing.T) {
	data, err := structpb.NewStruct(map[string]any{"n": 1.5, "list": []any{"a", nil, true}, "obj": map[string]any{"k": "v"}})
	require.NoError(t, err)
	at := timestamppb.New(time.Unix(1700000000, 42))
	evs := []*runtimev1.RuntimeEvent{
		{EventId: "e1", RuntimeSessionId: "rs1", MessageId: "m1", Kind: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL,
			Text: "t", ToolName: "bash", Data: data, Time: at},
		{EventId: "e2", Kind: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA, Data: &structpb.Struct{}},
		{EventId: "e3"},
	}
	got := EventsProto(Request(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_RuntimeEvents{
		RuntimeEvents: &sandboxv1.RuntimeEvents{SessionId: "s1", Events: evs}}}).(driver.RuntimeEvents).Events)
	require.Len(t, got, len(evs))
	for i := range evs {
		requireProto(t, evs[i], got[i])
	}
	for kind := range runtimev1.RuntimeEventKind_name {
		e := &runtimev1.RuntimeEvent{Kind: runtimev1.RuntimeEventKind(kind)}
		requireProto(t, e, EventsProto(events([]*runtimev1.RuntimeEvent{e}))[0])
	}

	o := &runtimev1.TurnOutcome{TurnId: "t1", RuntimeSessionId: "rs1", LastMessageId: "m2", Result: runtimev1.TurnResult_TURN_RESULT_FAILED,
		FailureReason: "agent_crashed", Summary: "s", Time: at}
	requireProto(t, o, OutcomeProto(Request(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Outcome{
		Outcome: &sandboxv1.TurnOutcome{SessionId: "s1", Outcome: o}}}).(driver.Outcome).Outcome))
	for result := range runtimev1.TurnResult_name {
		o := &runtimev1.TurnOutcome{Result: runtimev1.TurnResult(result)}
		requireProto(t, o, OutcomeProto(outcome(o)))
	}

	p := &runtimev1.ProgressStep{Step: "clone", Detail: "d", Time: at}
	requireProto(t, p, ProgressProto(progress(p)))
	requireProto(t, &runtimev1.ProgressStep{Step: "s"}, ProgressProto(progress(&runtimev1.ProgressStep{Step: "s"})))

	ch := &runtimev1.WorktreeChanges{Files: []*runtimev1.FileChange{
		{Path: "a", Kind: runtimev1.FileChangeKind_FILE_CHANGE_KIND_ADDED},
		{Path: "b", Kind: runtimev1.FileChangeKind_FILE_CHANGE_KIND_MODIFIED},
		{Path: "c", Kind: runtimev1.FileChangeKind_FILE_CHANGE_KIND_DELETED},
	}, Diff: "diff", DiffTruncated: true, HeadCommit: "abc", Time: at}
	res := Request(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_WorktreeResult{
		WorktreeResult: &sandboxv1.WorktreeResult{RequestId: "wt1", Changes: ch}}}).(driver.WorktreeResult)
	require.NotNil(t, res.Changes)
	requireProto(t, ch, WorktreeChangesProto(*res.Changes))
	requireProto(t, &runtimev1.WorktreeChanges{}, WorktreeChangesProto(gitrepo.Changes{}))
}
