package grpcapi

import (
	"context"
	"log/slog"

	"google.golang.org/protobuf/proto"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/session/internal/service"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// NotifyAPI serves SessionNotifyService (internal; called by the sandbox service).
type NotifyAPI struct {
	sessionv1.UnimplementedSessionNotifyServiceServer
	svc *service.Service
	log *slog.Logger
}

// NewNotifyAPI returns the internal notification API over svc.
func NewNotifyAPI(svc *service.Service, log *slog.Logger) *NotifyAPI {
	return &NotifyAPI{svc: svc, log: log}
}

func notice(r *sessionv1.RouteRef) session.Notice {
	return session.Notice{SandboxID: r.GetSandboxId(), FenceToken: r.GetFenceToken()}
}

func (a *NotifyAPI) fail(ctx context.Context, err error) error { return toStatus(ctx, a.log, err) }

func (a *NotifyAPI) NotifyRouteProgress(ctx context.Context, r *sessionv1.NotifyRouteProgressRequest) (*sessionv1.NotifyRouteProgressResponse, error) {
	if err := validateRoute(r.GetRoute()); err != nil {
		return nil, a.fail(ctx, err)
	}
	p := r.GetProgress()
	if p == nil {
		p = &runtimev1.ProgressStep{}
	}
	payload, err := proto.Marshal(p)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	err = a.svc.RouteProgress(ctx, r.GetRoute().GetSessionId(), notice(r.GetRoute()), p.GetStep(), payload)
	return &sessionv1.NotifyRouteProgressResponse{}, a.fail(ctx, err)
}

func (a *NotifyAPI) NotifyRouteReady(ctx context.Context, r *sessionv1.NotifyRouteReadyRequest) (*sessionv1.NotifyRouteReadyResponse, error) {
	if err := validateRoute(r.GetRoute()); err != nil {
		return nil, a.fail(ctx, err)
	}
	if err := session.Invalid(session.CheckOptionalID("runtime_session_id", r.GetRuntimeSessionId())); err != nil {
		return nil, a.fail(ctx, err)
	}
	err := a.svc.RouteReady(ctx, r.GetRoute().GetSessionId(), notice(r.GetRoute()), r.GetRuntimeSessionId(), r.GetWrapperInstance())
	return &sessionv1.NotifyRouteReadyResponse{}, a.fail(ctx, err)
}

func (a *NotifyAPI) NotifyRouteReconnecting(ctx context.Context, r *sessionv1.NotifyRouteReconnectingRequest) (*sessionv1.NotifyRouteReconnectingResponse, error) {
	if err := validateRoute(r.GetRoute()); err != nil {
		return nil, a.fail(ctx, err)
	}
	err := a.svc.RouteReconnecting(ctx, r.GetRoute().GetSessionId(), notice(r.GetRoute()))
	return &sessionv1.NotifyRouteReconnectingResponse{}, a.fail(ctx, err)
}

func (a *NotifyAPI) NotifyRouteFailed(ctx context.Context, r *sessionv1.NotifyRouteFailedRequest) (*sessionv1.NotifyRouteFailedResponse, error) {
	if err := validateRoute(r.GetRoute()); err != nil {
		return nil, a.fail(ctx, err)
	}
	err := a.svc.RouteFailed(ctx, r.GetRoute().GetSessionId(), notice(r.GetRoute()), r.GetReason())
	return &sessionv1.NotifyRouteFailedResponse{}, a.fail(ctx, err)
}

func (a *NotifyAPI) NotifyRouteLost(ctx context.Context, r *sessionv1.NotifyRouteLostRequest) (*sessionv1.NotifyRouteLostResponse, error) {
	if err := validateRoute(r.GetRoute()); err != nil {
		return nil, a.fail(ctx, err)
	}
	err := a.svc.RouteLost(ctx, r.GetRoute().GetSessionId(), notice(r.GetRoute()), r.GetReason())
	return &sessionv1.NotifyRouteLostResponse{}, a.fail(ctx, err)
}

func (a *NotifyAPI) NotifyRuntimeEvents(ctx context.Context, r *sessionv1.NotifyRuntimeEventsRequest) (*sessionv1.NotifyRuntimeEventsResponse, error) {
	if err := validateRoute(r.GetRoute()); err != nil {
		return nil, a.fail(ctx, err)
	}
	var vs []session.Violation
	events := make([]store.RuntimeEvent, 0, len(r.GetEvents()))
	for _, e := range r.GetEvents() {
		if e.GetEventId() == "" || len(e.GetEventId()) > 256 {
			vs = append(vs, session.Violation{Field: "events.event_id", Description: "1 to 256 bytes required"})
			continue
		}
		payload, err := proto.Marshal(e)
		if err != nil {
			return nil, a.fail(ctx, err)
		}
		events = append(events, store.RuntimeEvent{ID: e.GetEventId(), Payload: payload})
	}
	if err := session.Invalid(vs); err != nil {
		return nil, a.fail(ctx, err)
	}
	err := a.svc.RuntimeEvents(ctx, r.GetRoute().GetSessionId(), notice(r.GetRoute()), events)
	return &sessionv1.NotifyRuntimeEventsResponse{}, a.fail(ctx, err)
}

func (a *NotifyAPI) NotifyTurnOutcome(ctx context.Context, r *sessionv1.NotifyTurnOutcomeRequest) (*sessionv1.NotifyTurnOutcomeResponse, error) {
	if err := validateRoute(r.GetRoute()); err != nil {
		return nil, a.fail(ctx, err)
	}
	o := r.GetOutcome()
	var vs []session.Violation
	if o.GetTurnId() == "" || len(o.GetTurnId()) > 256 {
		vs = append(vs, session.Violation{Field: "outcome.turn_id", Description: "1 to 256 bytes required"})
	}
	vs = append(vs, session.CheckOptionalID("outcome.last_message_id", o.GetLastMessageId())...)
	var result session.TurnResult
	switch o.GetResult() {
	case runtimev1.TurnResult_TURN_RESULT_SUCCEEDED:
		result = session.TurnSucceeded
	case runtimev1.TurnResult_TURN_RESULT_FAILED:
		result = session.TurnFailed
	case runtimev1.TurnResult_TURN_RESULT_CANCELLED:
		result = session.TurnCancelled
	default:
		vs = append(vs, session.Violation{Field: "outcome.result", Description: "must be SUCCEEDED, FAILED or CANCELLED"})
	}
	if err := session.Invalid(vs); err != nil {
		return nil, a.fail(ctx, err)
	}
	payload, err := proto.Marshal(o)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	err = a.svc.TurnOutcome(ctx, r.GetRoute().GetSessionId(), notice(r.GetRoute()), service.Outcome{
		TurnID: o.GetTurnId(), LastMessageID: o.GetLastMessageId(), Result: result,
		FailureReason: o.GetFailureReason(), Payload: payload,
	})
	return &sessionv1.NotifyTurnOutcomeResponse{}, a.fail(ctx, err)
}
