package grpcapi

import (
	"agentplane.dev/pkg/egresspolicy"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

func ts(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func classToDomain(c sessionv1.CredentialClass) session.CredentialClass {
	if c == sessionv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED {
		return session.CredentialDelegated
	}
	return session.CredentialStatic
}

func classToProto(c session.CredentialClass) sessionv1.CredentialClass {
	switch c {
	case session.CredentialDelegated:
		return sessionv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED
	case session.CredentialStatic:
		return sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC
	}
	return sessionv1.CredentialClass_CREDENTIAL_CLASS_UNSPECIFIED
}

var routeStates = map[session.RouteState]sessionv1.RouteState{
	session.RouteUnknown:      sessionv1.RouteState_ROUTE_STATE_UNKNOWN,
	session.RoutePreparing:    sessionv1.RouteState_ROUTE_STATE_PREPARING,
	session.RouteReady:        sessionv1.RouteState_ROUTE_STATE_READY,
	session.RouteReconnecting: sessionv1.RouteState_ROUTE_STATE_RECONNECTING,
	session.RouteFailed:       sessionv1.RouteState_ROUTE_STATE_FAILED,
	session.RouteSuspended:    sessionv1.RouteState_ROUTE_STATE_SUSPENDED,
}

var sessionStates = map[session.State]sessionv1.SessionState{
	session.StateActive:   sessionv1.SessionState_SESSION_STATE_ACTIVE,
	session.StateStopped:  sessionv1.SessionState_SESSION_STATE_STOPPED,
	session.StateDeleting: sessionv1.SessionState_SESSION_STATE_DELETING,
}

var messageStates = map[session.MessageState]sessionv1.MessageState{
	session.MessageQueued:    sessionv1.MessageState_MESSAGE_STATE_QUEUED,
	session.MessageAccepted:  sessionv1.MessageState_MESSAGE_STATE_ACCEPTED,
	session.MessageCompleted: sessionv1.MessageState_MESSAGE_STATE_COMPLETED,
	session.MessageFailed:    sessionv1.MessageState_MESSAGE_STATE_FAILED,
	session.MessageCancelled: sessionv1.MessageState_MESSAGE_STATE_CANCELLED,
}

func routeToProto(v *session.RouteView) *sessionv1.RouteView {
	out := &sessionv1.RouteView{
		State: routeStates[v.State], Step: v.Step, FailureReason: v.FailureReason,
		RuntimeSessionId: v.RuntimeSessionID, SandboxId: v.SandboxID, WrapperInstance: v.WrapperInstance,
		UpdateTime: ts(v.UpdateTime),
	}
	if v.AgentProfile != "" {
		out.Agent = &sessionv1.Agent{Profile: v.AgentProfile, Model: v.AgentModel}
	}
	return out
}

func sessionToProto(s *session.Session) *sessionv1.Session {
	return &sessionv1.Session{
		SessionId: s.ID, UserId: s.UserID, OrgId: s.OrgID,
		Worktree:        &sessionv1.Worktree{RepoUrl: s.RepoURL, Directory: s.Directory, Ref: s.RepoRef, Depth: s.RepoDepth},
		CredentialClass: classToProto(s.CredentialClass), State: sessionStates[s.State],
		Route: routeToProto(&s.Route), SandboxId: s.SandboxID,
		CreateTime: ts(s.CreateTime), UpdateTime: ts(s.UpdateTime), Labels: s.Labels, Agent: agentToProto(s.Agent),
		Egress: egressToProto(s.Egress), EgressVersion: s.EgressVersion,
		SuspendAfter: durationToProto(s.SuspendAfter), PushBranchPrefix: s.PushBranchPrefix(),
		Usage: usageToProto(s.Usage),
	}
}

func usageToProto(u session.Usage) *runtimev1.TokenUsage {
	return &runtimev1.TokenUsage{InputTokens: u.Input, OutputTokens: u.Output, CachedTokens: u.Cached, Requests: u.Requests, Model: u.Model, CostUsd: u.CostUSD}
}

func durationToProto(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}

func egressToProto(p egresspolicy.Policy) *sessionv1.EgressPolicy {
	if p.Empty() {
		return nil
	}
	out := &sessionv1.EgressPolicy{PrivateNetworks: p.PrivateNetworks}
	for _, r := range p.Allow {
		out.Allow = append(out.Allow, &sessionv1.EgressRule{Host: r.Host, Ports: r.Ports})
	}
	return out
}

func egressFromProto(p *sessionv1.EgressPolicy) egresspolicy.Policy {
	out := egresspolicy.Policy{PrivateNetworks: p.GetPrivateNetworks()}
	for _, r := range p.GetAllow() {
		out.Allow = append(out.Allow, egresspolicy.Rule{Host: r.GetHost(), Ports: r.GetPorts()})
	}
	return out
}

func agentToProto(a session.Agent) *sessionv1.Agent {
	if a.Profile == "" && a.Model == "" && len(a.RejectToolKinds) == 0 {
		return nil
	}
	return &sessionv1.Agent{Profile: a.Profile, Model: a.Model, RejectToolKinds: a.RejectToolKinds}
}

func messageToProto(m *session.Message) *sessionv1.Message {
	return &sessionv1.Message{
		SessionId: m.SessionID, MessageId: m.ID, Content: m.Content, State: messageStates[m.State],
		FailureReason: m.FailureReason, Sequence: m.Seq, CreateTime: ts(m.CreateTime), UpdateTime: ts(m.UpdateTime),
	}
}

func eventToProto(e store.StoredEvent) (*sessionv1.SessionEvent, error) {
	out := &sessionv1.SessionEvent{Cursor: e.Cursor, Time: ts(e.Time)}
	switch e.Kind {
	case session.EventRoute:
		out.Kind = &sessionv1.SessionEvent_Route{Route: routeToProto(e.Route)}
	case session.EventMessage:
		out.Kind = &sessionv1.SessionEvent_Message{Message: messageToProto(e.Message)}
	case session.EventSession:
		out.Kind = &sessionv1.SessionEvent_Session{Session: sessionToProto(e.Session)}
	case session.EventRuntime:
		v := new(runtimev1.RuntimeEvent)
		if err := proto.Unmarshal(e.Payload, v); err != nil {
			return nil, err
		}
		out.Kind = &sessionv1.SessionEvent_RuntimeEvent{RuntimeEvent: v}
	case session.EventOutcome:
		v := new(runtimev1.TurnOutcome)
		if err := proto.Unmarshal(e.Payload, v); err != nil {
			return nil, err
		}
		out.Kind = &sessionv1.SessionEvent_Outcome{Outcome: v}
	case session.EventProgress:
		v := new(runtimev1.ProgressStep)
		if err := proto.Unmarshal(e.Payload, v); err != nil {
			return nil, err
		}
		out.Kind = &sessionv1.SessionEvent_Progress{Progress: v}
	default:
		return nil, fmt.Errorf("unknown event kind %q", e.Kind)
	}
	return out, nil
}
