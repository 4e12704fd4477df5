// Package wrapperconn is the wrapper-connection adapter: the one place that
// converts WrapperControlService frames (sandboxv1, with the runtimev1
// reports they carry) to and from the driver's domain frames. The driver
// speaks driver.FromWrapper / driver.ToWrapper only; grpcapi serves the
// stream through Stream, and internal/edge/notify uses the runtime conversions
// here for what it relays to the session service.
package wrapperconn

import (
	"google.golang.org/protobuf/types/known/durationpb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/control/scope"
)

// Stream is a wrapper's Connect stream in domain frames.
type Stream struct {
	S sandboxv1.WrapperControlService_ConnectServer
}

// Recv reads the next frame; a frame of a kind this service does not know
// (a newer wrapper) is nil, to be ignored.
func (s Stream) Recv() (driver.FromWrapper, error) {
	f, err := s.S.Recv()
	if err != nil {
		return nil, err
	}
	return Request(f), nil
}

// Send writes a frame.
func (s Stream) Send(m driver.ToWrapper) error { return s.S.Send(Response(m)) }

// Request is the domain frame of a wrapper's frame; nil when it carries
// none this service knows.
func Request(f *sandboxv1.ConnectRequest) driver.FromWrapper {
	switch x := f.GetFrame().(type) {
	case *sandboxv1.ConnectRequest_Hello:
		return hello(x.Hello)
	case *sandboxv1.ConnectRequest_Heartbeat:
		return driver.Heartbeat{BusySessionIDs: x.Heartbeat.GetBusySessionIds()}
	case *sandboxv1.ConnectRequest_Progress:
		return driver.Progress{SessionID: x.Progress.GetSessionId(), Step: progress(x.Progress.GetProgress())}
	case *sandboxv1.ConnectRequest_RouteReady:
		return driver.RouteReady{SessionID: x.RouteReady.GetSessionId(), RuntimeSessionID: x.RouteReady.GetRuntimeSessionId()}
	case *sandboxv1.ConnectRequest_RouteFailed:
		return driver.RouteFailed{SessionID: x.RouteFailed.GetSessionId(), Reason: x.RouteFailed.GetReason(), Retryable: x.RouteFailed.GetRetryable()}
	case *sandboxv1.ConnectRequest_RuntimeEvents:
		return driver.RuntimeEvents{SessionID: x.RuntimeEvents.GetSessionId(), Events: events(x.RuntimeEvents.GetEvents())}
	case *sandboxv1.ConnectRequest_Outcome:
		return driver.Outcome{SessionID: x.Outcome.GetSessionId(), Outcome: outcome(x.Outcome.GetOutcome())}
	case *sandboxv1.ConnectRequest_WorktreeResult:
		return worktreeResult(x.WorktreeResult)
	}
	return nil
}

func hello(h *sandboxv1.Hello) driver.Hello {
	routes := make([]driver.ActiveRoute, 0, len(h.GetRoutes()))
	for _, a := range h.GetRoutes() {
		routes = append(routes, driver.ActiveRoute{SessionID: a.GetSessionId(), RuntimeSessionID: a.GetRuntimeSessionId()})
	}
	return driver.Hello{
		SandboxID: h.GetSandboxId(), AllocationID: h.GetAllocationId(), RuntimeKey: h.GetRuntimeKey(), InstanceID: h.GetInstanceId(),
		Generation: h.GetGeneration(), FenceToken: h.GetFenceToken(), LaunchCredential: h.GetLaunchCredential(),
		Capabilities: h.GetCapabilities(), ProtocolVersion: h.GetProtocolVersion(), Routes: routes,
	}
}

func worktreeResult(r *sandboxv1.WorktreeResult) driver.WorktreeResult {
	res := driver.WorktreeResult{
		RequestID: r.GetRequestId(), CommitID: r.GetCommitId(), Ref: r.GetRef(), Committed: r.GetCommitted(),
		ErrorReason: r.GetErrorReason(), ErrorDetail: r.GetErrorDetail(),
		Files: worktreeFiles(r.GetFiles()), FilesMore: r.GetFilesMore(), Data: r.GetData(), FileSize: r.GetFileSize(),
		FilesWritten: int(r.GetFilesWritten()), BytesWritten: r.GetBytesWritten(),
	}
	if r.GetChanges() != nil {
		ch := worktreeChanges(r.GetChanges())
		res.Changes = &ch
	}
	return res
}

// Response is the wire frame of a domain frame.
func Response(m driver.ToWrapper) *sandboxv1.ConnectResponse {
	switch x := m.(type) {
	case driver.HelloAck:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_HelloAck{HelloAck: &sandboxv1.HelloAck{
			HeartbeatInterval: durationpb.New(x.Heartbeat), ReconnectWindow: durationpb.New(x.ReconnectWindow),
			Contract: ContractProto(x.Contract),
		}}}
	case driver.PrepareRoute:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_PrepareRoute{PrepareRoute: prepareRoute(x)}}
	case driver.Delivery:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Deliver{Deliver: delivery(x)}}
	case driver.Abort:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Abort{Abort: &sandboxv1.Abort{SessionId: x.SessionID, MessageId: x.MessageID}}}
	case driver.HandleUpdate:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Credentials{Credentials: &sandboxv1.Credentials{SessionIds: x.SessionIDs, Handle: x.Handle}}}
	case driver.Shutdown:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_Shutdown{Shutdown: &sandboxv1.Shutdown{Reason: shutdownReasons[x.Reason], Detail: x.Detail}}}
	case driver.ReleaseRoute:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_ReleaseRoute{ReleaseRoute: &sandboxv1.ReleaseRoute{SessionId: x.SessionID}}}
	case driver.WorktreeRequest:
		return &sandboxv1.ConnectResponse{Frame: &sandboxv1.ConnectResponse_WorktreeRequest{WorktreeRequest: worktreeRequest(x)}}
	}
	panic("wrapperconn: a driver frame without a wire form") // every ToWrapper is listed above
}

func prepareRoute(x driver.PrepareRoute) *sandboxv1.PrepareRoute {
	return &sandboxv1.PrepareRoute{
		SessionId: x.SessionID, Directory: x.Directory, RepoUrl: x.RepoURL, Handle: x.Handle,
		ProxyUrl: x.ProxyURL, Contract: ContractProto(x.Contract), RuntimeSessionId: x.RuntimeSessionID,
		Agent:   &sandboxv1.Agent{Profile: x.Agent.Profile, Model: x.Agent.Model, RejectToolKinds: x.Agent.RejectToolKinds},
		RepoRef: x.RepoRef, RepoDepth: x.RepoDepth, CloneRepo: x.CloneRepo, Traceparent: x.Traceparent,
	}
}

func delivery(x driver.Delivery) *sandboxv1.Deliver {
	d := &sandboxv1.Deliver{SessionId: x.SessionID, Traceparent: x.Traceparent, Messages: make([]*sandboxv1.DeliveryMessage, 0, len(x.Messages))}
	for _, m := range x.Messages {
		d.Messages = append(d.Messages, &sandboxv1.DeliveryMessage{MessageId: m.ID, Content: m.Content})
	}
	return d
}

func worktreeRequest(x driver.WorktreeRequest) *sandboxv1.WorktreeRequest {
	r := &sandboxv1.WorktreeRequest{RequestId: x.RequestID, SessionId: x.SessionID}
	switch {
	case x.Push != nil:
		r.Action = &sandboxv1.WorktreeRequest_Push{Push: &sandboxv1.WorktreePushAction{
			Branch: x.Push.Branch, CommitMessage: x.Push.CommitMessage, AuthorName: x.Push.AuthorName, AuthorEmail: x.Push.AuthorEmail,
		}}
	case x.List != nil:
		r.Action = &sandboxv1.WorktreeRequest_List{List: &sandboxv1.WorktreeListAction{Path: x.List.Path, After: x.List.After, Limit: int32(x.List.Limit)}} //nolint:gosec // bounded by the API's validation
	case x.Write != nil:
		w := &sandboxv1.WorktreeWriteAction{Files: make([]*runtimev1.WorktreeFileWrite, 0, len(x.Write))}
		for _, f := range x.Write {
			w.Files = append(w.Files, &runtimev1.WorktreeFileWrite{Path: f.Path, Data: f.Data, Mode: f.Mode})
		}
		r.Action = &sandboxv1.WorktreeRequest_Write{Write: w}
	case x.Read != nil:
		r.Action = &sandboxv1.WorktreeRequest_Read{Read: &sandboxv1.WorktreeReadAction{Path: x.Read.Path, Offset: x.Read.Offset, Length: int32(x.Read.Length)}} //nolint:gosec // bounded by the API's validation
	default:
		r.Action = &sandboxv1.WorktreeRequest_Changes{Changes: &sandboxv1.WorktreeChangesAction{}}
	}
	return r
}

var shutdownReasons = map[driver.ShutdownReason]sandboxv1.ShutdownReason{
	driver.StaleAllocation: sandboxv1.ShutdownReason_SHUTDOWN_REASON_STALE_ALLOCATION,
	driver.StaleFence:      sandboxv1.ShutdownReason_SHUTDOWN_REASON_STALE_FENCE,
	driver.BadCredential:   sandboxv1.ShutdownReason_SHUTDOWN_REASON_BAD_CREDENTIAL,
	driver.LeaseLost:       sandboxv1.ShutdownReason_SHUTDOWN_REASON_LEASE_LOST,
	driver.StopRequested:   sandboxv1.ShutdownReason_SHUTDOWN_REASON_STOP_REQUESTED,
}

// ContractProto is a runtime contract on the wire (wrapper frames and the
// SandboxService views alike).
func ContractProto(c scope.Contract) sandboxv1.RuntimeContract {
	switch c {
	case scope.Worktree:
		return sandboxv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE
	case scope.PerSession:
		return sandboxv1.RuntimeContract_RUNTIME_CONTRACT_PER_SESSION
	}
	return sandboxv1.RuntimeContract_RUNTIME_CONTRACT_UNSPECIFIED
}
