package grpcapi

import (
	"encoding/base64"
	"strconv"
	"strings"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Request validators: every field of outside input is checked before any
// state is read or written, and every problem is reported at once.

func validateCreate(r *sessionv1.CreateSessionRequest) error {
	var vs []session.Violation
	vs = append(vs, session.CheckOptionalID("session_id", r.GetSessionId())...)
	vs = append(vs, session.CheckID("user_id", r.GetUserId())...)
	vs = append(vs, session.CheckID("org_id", r.GetOrgId())...)
	vs = append(vs, session.CheckDirectory("worktree.directory", r.GetWorktree().GetDirectory())...)
	vs = append(vs, session.CheckRepoURL("worktree.repo_url", r.GetWorktree().GetRepoUrl())...)
	vs = append(vs, session.CheckCloneURL("worktree.repo_url", r.GetWorktree().GetRepoUrl())...)
	vs = append(vs, session.CheckRef("worktree.ref", r.GetWorktree().GetRef())...)
	if r.GetWorktree().GetDepth() > session.MaxDepth {
		vs = append(vs, session.Violation{Field: "worktree.depth", Description: "at most 1048576"})
	}
	if g := r.GetGitCredential(); g != nil {
		if r.GetWorktree().GetRepoUrl() == "" {
			vs = append(vs, session.Violation{Field: "git_credential", Description: "needs worktree.repo_url"})
		}
		vs = append(vs, session.CheckSecret("git_credential.token", g.GetToken())...)
		if len(g.GetUsername()) > 256 || strings.ContainsAny(g.GetUsername(), ":\r\n") {
			vs = append(vs, session.Violation{Field: "git_credential.username", Description: "at most 256 bytes, no colon or line break"})
		}
	}
	switch r.GetCredential().GetClass() {
	case sessionv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED, sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC:
	default:
		vs = append(vs, session.Violation{Field: "credential.class", Description: "must be DELEGATED or STATIC"})
	}
	vs = append(vs, session.CheckSecret("credential.secret", r.GetCredential().GetSecret())...)
	vs = append(vs, session.CheckOptionalID("sandbox_id", r.GetSandboxId())...)
	vs = append(vs, session.CheckLabels("labels", r.GetLabels())...)
	if a := r.GetAgent(); a != nil {
		if len(a.GetProfile()) > 64 {
			vs = append(vs, session.Violation{Field: "agent.profile", Description: "at most 64 bytes"})
		}
		if len(a.GetModel()) > 128 {
			vs = append(vs, session.Violation{Field: "agent.model", Description: "at most 128 bytes"})
		}
		if len(a.GetRejectToolKinds()) > 16 {
			vs = append(vs, session.Violation{Field: "agent.reject_tool_kinds", Description: "at most 16 tool kinds"})
		}
	}
	return session.Invalid(vs)
}

func validatePush(r *sessionv1.PushWorktreeRequest) error {
	vs := session.CheckID("session_id", r.GetSessionId())
	vs = append(vs, session.CheckBranch("branch", r.GetBranch())...)
	vs = append(vs, session.CheckCommitMessage("commit_message", r.GetCommitMessage())...)
	return session.Invalid(vs)
}

func validateSessionID(id string) error { return session.Invalid(session.CheckID("session_id", id)) }

func validateMessageRef(sessionID, messageID string) error {
	return session.Invalid(append(session.CheckID("session_id", sessionID), session.CheckID("message_id", messageID)...))
}

func validateSend(r *sessionv1.SendMessageRequest) error {
	vs := session.CheckID("session_id", r.GetSessionId())
	vs = append(vs, session.CheckID("message_id", r.GetMessageId())...)
	vs = append(vs, session.CheckContent("content", r.GetContent())...)
	return session.Invalid(vs)
}

func validateList(r *sessionv1.ListSessionsRequest) (cursor string, err error) {
	vs := session.CheckID("org_id", r.GetOrgId())
	vs = append(vs, session.CheckOptionalID("user_id", r.GetUserId())...)
	vs = append(vs, session.CheckPageSize("page_size", r.GetPageSize())...)
	if t := r.GetPageToken(); t != "" {
		raw, derr := base64.RawURLEncoding.DecodeString(t)
		if derr != nil || !store.ValidPageCursor(string(raw)) {
			vs = append(vs, session.Violation{Field: "page_token", Description: "not a token from a previous response"})
		} else {
			cursor = string(raw)
		}
	}
	return cursor, session.Invalid(vs)
}

func validateListMessages(r *sessionv1.ListMessagesRequest) (after uint64, err error) {
	vs := session.CheckID("session_id", r.GetSessionId())
	vs = append(vs, session.CheckPageSize("page_size", r.GetPageSize())...)
	if t := r.GetPageToken(); t != "" {
		raw, derr := base64.RawURLEncoding.DecodeString(t)
		n, perr := strconv.ParseUint(string(raw), 10, 64)
		if derr != nil || perr != nil || n == 0 {
			vs = append(vs, session.Violation{Field: "page_token", Description: "not a token from a previous response"})
		}
		after = n
	}
	return after, session.Invalid(vs)
}

func validateWatch(r *sessionv1.WatchSessionRequest) error {
	vs := session.CheckID("session_id", r.GetSessionId())
	if c := r.GetCursor(); c != "" && c != "$" && !store.ValidCursor(c) {
		vs = append(vs, session.Violation{Field: "cursor", Description: "must be empty, \"$\" or a cursor from a SessionEvent"})
	}
	return session.Invalid(vs)
}

func validateRoute(r *sessionv1.RouteRef) error {
	vs := session.CheckID("route.session_id", r.GetSessionId())
	vs = append(vs, session.CheckOptionalID("route.sandbox_id", r.GetSandboxId())...)
	return session.Invalid(vs)
}

func encodeToken(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
