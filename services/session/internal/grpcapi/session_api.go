package grpcapi

import (
	"google.golang.org/protobuf/proto"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"context"
	"log/slog"
	"strconv"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/session/internal/service"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// SessionAPI serves SessionService.
type SessionAPI struct {
	sessionv1.UnimplementedSessionServiceServer
	svc *service.Service
	log *slog.Logger
}

// NewSessionAPI returns the public API over svc.
func NewSessionAPI(svc *service.Service, log *slog.Logger) *SessionAPI {
	return &SessionAPI{svc: svc, log: log}
}

func (a *SessionAPI) fail(ctx context.Context, err error) error { return toStatus(ctx, a.log, err) }

func (a *SessionAPI) CreateSession(ctx context.Context, r *sessionv1.CreateSessionRequest) (*sessionv1.CreateSessionResponse, error) {
	if err := validateCreate(r); err != nil {
		return nil, a.fail(ctx, err)
	}
	if err := directoryReserved(r.GetWorktree().GetDirectory()); err != nil {
		return nil, err
	}
	s, err := a.svc.Create(ctx, service.CreateInput{
		ID: r.GetSessionId(), UserID: r.GetUserId(), OrgID: r.GetOrgId(),
		RepoURL: r.GetWorktree().GetRepoUrl(), Directory: r.GetWorktree().GetDirectory(),
		Class: classToDomain(r.GetCredential().GetClass()), Secret: r.GetCredential().GetSecret(),
		SandboxID: r.GetSandboxId(), Labels: r.GetLabels(),
		Agent:   session.Agent{Profile: r.GetAgent().GetProfile(), Model: r.GetAgent().GetModel(), RejectToolKinds: r.GetAgent().GetRejectToolKinds()},
		RepoRef: r.GetWorktree().GetRef(), RepoDepth: r.GetWorktree().GetDepth(),
		GitToken: r.GetGitCredential().GetToken(), GitUsername: r.GetGitCredential().GetUsername(),
		GitPushPrefix: r.GetGitCredential().GetPushBranchPrefix(),
		Egress:        egressFromProto(r.GetEgress()),
		SuspendAfter:  r.GetSuspendAfter().AsDuration(),
	})
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.CreateSessionResponse{Session: sessionToProto(s)}, nil
}

func (a *SessionAPI) GetSession(ctx context.Context, r *sessionv1.GetSessionRequest) (*sessionv1.GetSessionResponse, error) {
	if err := validateSessionID(r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	s, err := a.svc.Get(ctx, r.GetSessionId())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.GetSessionResponse{Session: sessionToProto(s)}, nil
}

func (a *SessionAPI) ListSessions(ctx context.Context, r *sessionv1.ListSessionsRequest) (*sessionv1.ListSessionsResponse, error) {
	cursor, err := validateList(r)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	size := int(r.GetPageSize())
	if size == 0 {
		size = 50
	}
	list, next, err := a.svc.List(ctx, r.GetOrgId(), r.GetUserId(), cursor, size)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	resp := &sessionv1.ListSessionsResponse{}
	for _, s := range list {
		resp.Sessions = append(resp.Sessions, sessionToProto(s))
	}
	if next != "" {
		resp.NextPageToken = encodeToken(next)
	}
	return resp, nil
}

func (a *SessionAPI) SendMessage(ctx context.Context, r *sessionv1.SendMessageRequest) (*sessionv1.SendMessageResponse, error) {
	if err := validateSend(r); err != nil {
		return nil, a.fail(ctx, err)
	}
	m, err := a.svc.Send(ctx, r.GetSessionId(), r.GetMessageId(), r.GetContent())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.SendMessageResponse{Message: messageToProto(m)}, nil
}

func (a *SessionAPI) GetMessage(ctx context.Context, r *sessionv1.GetMessageRequest) (*sessionv1.GetMessageResponse, error) {
	if err := validateMessageRef(r.GetSessionId(), r.GetMessageId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	m, err := a.svc.GetMessage(ctx, r.GetSessionId(), r.GetMessageId())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.GetMessageResponse{Message: messageToProto(m)}, nil
}

func (a *SessionAPI) ListMessages(ctx context.Context, r *sessionv1.ListMessagesRequest) (*sessionv1.ListMessagesResponse, error) {
	after, err := validateListMessages(r)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	size := int(r.GetPageSize())
	if size == 0 {
		size = 100
	}
	msgs, more, err := a.svc.ListMessages(ctx, r.GetSessionId(), after, size)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	resp := &sessionv1.ListMessagesResponse{}
	for _, m := range msgs {
		resp.Messages = append(resp.Messages, messageToProto(m))
	}
	if more && len(msgs) > 0 {
		resp.NextPageToken = encodeToken(strconv.FormatUint(msgs[len(msgs)-1].Seq, 10))
	}
	return resp, nil
}

func (a *SessionAPI) CancelMessage(ctx context.Context, r *sessionv1.CancelMessageRequest) (*sessionv1.CancelMessageResponse, error) {
	if err := validateMessageRef(r.GetSessionId(), r.GetMessageId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	m, err := a.svc.Cancel(ctx, r.GetSessionId(), r.GetMessageId())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.CancelMessageResponse{Message: messageToProto(m)}, nil
}

func (a *SessionAPI) StopSession(ctx context.Context, r *sessionv1.StopSessionRequest) (*sessionv1.StopSessionResponse, error) {
	if err := validateSessionID(r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	s, err := a.svc.Stop(ctx, r.GetSessionId())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.StopSessionResponse{Session: sessionToProto(s)}, nil
}

func (a *SessionAPI) SuspendSession(ctx context.Context, r *sessionv1.SuspendSessionRequest) (*sessionv1.SuspendSessionResponse, error) {
	if err := validateSessionID(r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	s, err := a.svc.Suspend(ctx, r.GetSessionId(), r.GetForce())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.SuspendSessionResponse{Session: sessionToProto(s)}, nil
}

func (a *SessionAPI) ResumeSession(ctx context.Context, r *sessionv1.ResumeSessionRequest) (*sessionv1.ResumeSessionResponse, error) {
	if err := validateSessionID(r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	s, err := a.svc.Resume(ctx, r.GetSessionId(), r.GetRestart())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.ResumeSessionResponse{Session: sessionToProto(s)}, nil
}

func (a *SessionAPI) DeleteSession(ctx context.Context, r *sessionv1.DeleteSessionRequest) (*sessionv1.DeleteSessionResponse, error) {
	if err := validateSessionID(r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	if err := a.svc.Delete(ctx, r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.DeleteSessionResponse{}, nil
}

func (a *SessionAPI) WatchSession(r *sessionv1.WatchSessionRequest, stream sessionv1.SessionService_WatchSessionServer) error {
	ctx := stream.Context()
	if err := validateWatch(r); err != nil {
		return a.fail(ctx, err)
	}
	err := a.svc.Watch(ctx, r.GetSessionId(), r.GetCursor(), func(e store.StoredEvent) error {
		ev, err := eventToProto(e)
		if err != nil {
			return err
		}
		return stream.Send(&sessionv1.WatchSessionResponse{Event: ev})
	})
	return a.fail(ctx, err)
}

// ExportHistory pages the session's whole history (every runtime session
// of it, in order).
func (a *SessionAPI) ExportHistory(ctx context.Context, r *sessionv1.ExportHistoryRequest) (*sessionv1.ExportHistoryResponse, error) {
	vs := session.CheckID("session_id", r.GetSessionId())
	if n := r.GetPageSize(); n < 0 || n > 1000 {
		vs = append(vs, session.Violation{Field: "page_size", Description: "0 to 1000"})
	}
	if len(r.GetPageToken()) > 1024 {
		vs = append(vs, session.Violation{Field: "page_token", Description: "not a token from a previous response"})
	}
	if err := session.Invalid(vs); err != nil {
		return nil, a.fail(ctx, err)
	}
	size := int(r.GetPageSize())
	if size == 0 {
		size = 256
	}
	items, next, err := a.svc.ExportHistory(ctx, r.GetSessionId(), r.GetPageToken(), size)
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	out := &sessionv1.ExportHistoryResponse{NextPageToken: next}
	for _, it := range items {
		item := &ingestv1.Item{}
		if err := proto.Unmarshal(it.Item, item); err != nil {
			return nil, a.fail(ctx, err)
		}
		out.Items = append(out.Items, &sessionv1.HistoryItem{RuntimeSessionId: it.RuntimeSessionID, Item: item})
	}
	return out, nil
}
