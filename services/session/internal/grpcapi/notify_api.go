package grpcapi

import (
	"context"
	"log/slog"
	"unicode/utf8"

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
		events = append(events, store.RuntimeEvent{ID: e.GetEventId(), Payload: payload, Audit: egressAudit(e)})
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
		WithUsage: func(u session.Usage) []byte {
			// The proxy's count replaces whatever the runtime said.
			withUsage := proto.CloneOf(o)
			withUsage.Usage = usageToProto(u)
			b, err := proto.Marshal(withUsage)
			if err != nil {
				return payload
			}
			return b
		},
	})
	return &sessionv1.NotifyTurnOutcomeResponse{}, a.fail(ctx, err)
}

// Bounds of a usage report: more is no real provider response's.
const (
	maxReportedTokens = 1 << 40
	maxModelName      = 96
)

// NotifyUsage counts one provider response's usage (from the credential
// proxy).
func (a *NotifyAPI) NotifyUsage(ctx context.Context, r *sessionv1.NotifyUsageRequest) (*sessionv1.NotifyUsageResponse, error) {
	vs := session.CheckID("session_id", r.GetSessionId())
	vs = append(vs, session.CheckOptionalID("sandbox_id", r.GetSandboxId())...)
	if len(r.GetRuntimeSessionId()) > 256 {
		vs = append(vs, session.Violation{Field: "runtime_session_id", Description: "at most 256 bytes"})
	}
	u := r.GetUsage()
	if u == nil {
		vs = append(vs, session.Violation{Field: "usage", Description: "required"})
	}
	for field, n := range map[string]uint64{"usage.input_tokens": u.GetInputTokens(), "usage.output_tokens": u.GetOutputTokens(), "usage.cached_tokens": u.GetCachedTokens()} {
		if n > maxReportedTokens {
			vs = append(vs, session.Violation{Field: field, Description: "at most 2^40"})
		}
	}
	if u.GetCachedTokens() > u.GetInputTokens() {
		vs = append(vs, session.Violation{Field: "usage.cached_tokens", Description: "must not exceed usage.input_tokens"})
	}
	if u.GetRequests() > 1 {
		vs = append(vs, session.Violation{Field: "usage.requests", Description: "one report is one response: 0 or 1"})
	}
	if len(u.GetModel()) > maxModelName || !utf8.ValidString(u.GetModel()) {
		vs = append(vs, session.Violation{Field: "usage.model", Description: "at most 96 bytes of UTF-8"})
	}
	if err := session.Invalid(vs); err != nil {
		return nil, a.fail(ctx, err)
	}
	err := a.svc.Usage(ctx, r.GetSessionId(), r.GetSandboxId(), session.Usage{
		Input: u.GetInputTokens(), Output: u.GetOutputTokens(), Cached: u.GetCachedTokens(), Requests: 1, Model: u.GetModel(),
	})
	return &sessionv1.NotifyUsageResponse{}, a.fail(ctx, err)
}
