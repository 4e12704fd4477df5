package grpcapi

import (
	"context"
	"math"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/session/internal/service"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Bounds of ListAuditRecords and NotifyAudit.
const (
	defaultAuditPage = 100
	maxAuditPage     = 1000
	maxAuditBatch    = 256
	maxAuditString   = 256
)

// ListAuditRecords pages a session's audit records.
func (a *SessionAPI) ListAuditRecords(ctx context.Context, r *sessionv1.ListAuditRecordsRequest) (*sessionv1.ListAuditRecordsResponse, error) {
	vs := session.CheckID("session_id", r.GetSessionId())
	vs = append(vs, session.CheckOptionalID("turn_id", r.GetTurnId())...)
	if n := r.GetPageSize(); n < 0 || n > maxAuditPage {
		vs = append(vs, session.Violation{Field: "page_size", Description: "0 to 1000"})
	}
	after := ""
	if tok := r.GetPageToken(); tok != "" {
		c, ok := decodeToken(tok)
		if !ok || !store.ValidAuditCursor(c) {
			vs = append(vs, session.Violation{Field: "page_token", Description: "not a token from a previous response"})
		}
		after = c
	}
	if err := session.Invalid(vs); err != nil {
		return nil, a.fail(ctx, err)
	}
	size := int(r.GetPageSize())
	if size == 0 {
		size = defaultAuditPage
	}
	recs, next, err := a.svc.ListAudit(ctx, r.GetSessionId(), after, r.GetTurnId(), size)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	out := &sessionv1.ListAuditRecordsResponse{}
	if next != "" {
		out.NextPageToken = encodeToken(next)
	}
	for i := range recs {
		out.Records = append(out.Records, auditToProto(r.GetSessionId(), &recs[i]))
	}
	return out, nil
}

func auditToProto(sessionID string, r *session.AuditRecord) *sessionv1.AuditRecord {
	out := &sessionv1.AuditRecord{
		RecordId: r.ID, SessionId: sessionID, TurnId: r.TurnID, RuntimeKey: r.RuntimeKey,
		RuntimeSessionId: r.RuntimeSessionID, Time: timestamppb.New(r.Time),
	}
	switch r.Kind {
	case session.AuditKindProxy:
		out.Kind = sessionv1.AuditKind_AUDIT_KIND_PROXY_REQUEST
	case session.AuditKindEgress:
		out.Kind = sessionv1.AuditKind_AUDIT_KIND_EGRESS
	}
	if p := r.Proxy; p != nil {
		out.ProxyRequest = &sessionv1.AuditProxyRequest{Route: p.Route, Method: p.Method, PathTemplate: p.PathTemplate,
			Status: int32(p.Status), BytesIn: p.BytesIn, BytesOut: p.BytesOut, Duration: durationpb.New(p.Duration)} //nolint:gosec // an HTTP status
	}
	if e := r.Egress; e != nil {
		out.Egress = &sessionv1.AuditEgressDecision{Host: e.Host, Port: int32(e.Port), Decision: e.Decision, Reason: e.Reason, //nolint:gosec // a port
			BytesUp: e.BytesUp, BytesDown: e.BytesDown, Connection: e.Connection, Expected: e.Expected, Count: e.Count}
	}
	return out
}

// NotifyAudit stores a batch of the credential proxy's request reports as
// audit records.
func (a *NotifyAPI) NotifyAudit(ctx context.Context, r *sessionv1.NotifyAuditRequest) (*sessionv1.NotifyAuditResponse, error) {
	var vs []session.Violation
	if len(r.GetReports()) > maxAuditBatch {
		vs = append(vs, session.Violation{Field: "reports", Description: "at most 256"})
	}
	reports := make([]service.ProxyReport, 0, len(r.GetReports()))
	for _, p := range r.GetReports() {
		vs = append(vs, session.CheckID("reports.session_id", p.GetSessionId())...)
		vs = append(vs, session.CheckOptionalID("reports.sandbox_id", p.GetSandboxId())...)
		q := p.GetRequest()
		if q == nil {
			vs = append(vs, session.Violation{Field: "reports.request", Description: "required"})
		}
		for field, v := range map[string]string{"reports.runtime_session_id": p.GetRuntimeSessionId(), "reports.runtime_key": p.GetRuntimeKey(),
			"reports.request.route": q.GetRoute(), "reports.request.method": q.GetMethod()} {
			if len(v) > maxAuditString || !utf8.ValidString(v) {
				vs = append(vs, session.Violation{Field: field, Description: "at most 256 bytes of UTF-8"})
			}
		}
		if len(q.GetPathTemplate()) > 4096 || !utf8.ValidString(q.GetPathTemplate()) {
			vs = append(vs, session.Violation{Field: "reports.request.path_template", Description: "at most 4096 bytes of UTF-8"})
		}
		if s := q.GetStatus(); s < 0 || s > 999 {
			vs = append(vs, session.Violation{Field: "reports.request.status", Description: "0 to 999"})
		}
		var start time.Time
		if p.GetStartTime() != nil {
			start = p.GetStartTime().AsTime()
		}
		reports = append(reports, service.ProxyReport{
			SessionID: p.GetSessionId(), SandboxID: p.GetSandboxId(), RuntimeSessionID: p.GetRuntimeSessionId(),
			RuntimeKey: p.GetRuntimeKey(), Start: start,
			Request: session.AuditProxy{Route: q.GetRoute(), Method: q.GetMethod(), PathTemplate: q.GetPathTemplate(),
				Status: int(q.GetStatus()), BytesIn: q.GetBytesIn(), BytesOut: q.GetBytesOut(), Duration: max(q.GetDuration().AsDuration(), 0)},
		})
	}
	if err := session.Invalid(vs); err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.NotifyAuditResponse{}, a.fail(ctx, a.svc.AuditProxyRequests(ctx, reports))
}

// egressAudit is the audit record an EGRESS runtime event makes (its data:
// kind, host, port, decision, reason, bytes_up, bytes_down, runtime_key,
// expected), or nil for any other event. The turn is the service's to
// name.
func egressAudit(e *runtimev1.RuntimeEvent) *session.AuditRecord {
	if e.GetKind() != runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_EGRESS {
		return nil
	}
	f := e.GetData().GetFields()
	str := func(k string) string {
		v := f[k].GetStringValue()
		if len(v) > maxAuditString {
			v = v[:maxAuditString]
		}
		return v
	}
	num := func(k string) uint64 {
		v := f[k].GetNumberValue()
		if v < 0 || math.IsNaN(v) || v > 1<<53 {
			return 0
		}
		return uint64(v)
	}
	var t time.Time
	if e.GetTime() != nil {
		t = e.GetTime().AsTime()
	}
	_, expected := f["expected"].GetKind().(*structpb.Value_BoolValue)
	expected = expected && f["expected"].GetBoolValue()
	return &session.AuditRecord{
		RuntimeKey: str("runtime_key"), RuntimeSessionID: e.GetRuntimeSessionId(), Kind: session.AuditKindEgress, Time: t,
		Egress: &session.AuditEgress{Host: str("host"), Port: int(min(num("port"), 65535)), Decision: str("decision"), Reason: str("reason"),
			Connection: str("kind"), BytesUp: num("bytes_up"), BytesDown: num("bytes_down"), Expected: expected},
	}
}
