package grpcapi

import (
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/ident"
	"agentplane.dev/services/session/internal/service"
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
		vs = append(vs, session.CheckPushPrefix("git_credential.push_branch_prefix", g.GetPushBranchPrefix())...)
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
	if d := r.GetSuspendAfter(); d != nil {
		if d.CheckValid() != nil {
			vs = append(vs, session.Violation{Field: "suspend_after", Description: "not a valid duration"})
		} else {
			vs = append(vs, session.CheckSuspendAfter("suspend_after", d.AsDuration())...)
		}
	}
	return session.Invalid(vs)
}

// directoryReserved refuses a well-formed directory the session's workspace
// cannot be bound at inside its sandbox (DESIGN.md 3.6: the agent works at
// the session's directory): a system path every sandbox mounts itself, or
// /tmp. Its own reason, after the field checks, so a client can tell "pick
// another directory" from a malformed request.
func directoryReserved(dir string) error {
	why := ident.ReservedDirectory(dir)
	if why == "" {
		return nil
	}
	return apierr.Error(codes.InvalidArgument, ReasonDirectoryReserved,
		"worktree.directory is where the agent works inside its sandbox and cannot be there: "+why,
		apierr.FieldViolation("worktree.directory", why))
}

func validatePush(r *sessionv1.PushWorktreeRequest) error {
	vs := session.CheckID("session_id", r.GetSessionId())
	vs = append(vs, session.CheckBranch("branch", r.GetBranch())...)
	vs = append(vs, session.CheckCommitMessage("commit_message", r.GetCommitMessage())...)
	vs = append(vs, session.CheckAuthorName("author_name", r.GetAuthorName())...)
	vs = append(vs, session.CheckAuthorEmail("author_email", r.GetAuthorEmail())...)
	return session.Invalid(vs)
}

// validateListFiles checks a listing and returns the wrapper's page: the
// token is the last name of the previous page.
func validateListFiles(r *sessionv1.ListWorktreeFilesRequest) (service.FileList, error) {
	l := service.FileList{Path: r.GetPath(), Limit: int(r.GetPageSize())}
	vs := session.CheckID("session_id", r.GetSessionId())
	vs = append(vs, violation("path", ident.WorktreePath(r.GetPath()))...)
	if l.Limit < 0 || l.Limit > ident.MaxWorktreeEntries {
		vs = append(vs, session.Violation{Field: "page_size", Description: "0 (1000) to 1000"})
	}
	if l.Limit == 0 {
		l.Limit = ident.MaxWorktreeEntries
	}
	if t := r.GetPageToken(); t != "" {
		raw, err := base64.RawURLEncoding.DecodeString(t)
		if err != nil || len(raw) == 0 || len(raw) > 255 || strings.ContainsAny(string(raw), "/\x00") {
			vs = append(vs, session.Violation{Field: "page_token", Description: "not a token from a previous response"})
		}
		l.After = string(raw)
	}
	return l, session.Invalid(vs)
}

func validateReadFile(r *sessionv1.ReadWorktreeFileRequest) error {
	vs := session.CheckID("session_id", r.GetSessionId())
	if r.GetPath() == "" {
		vs = append(vs, session.Violation{Field: "path", Description: "a file relative to the worktree"})
	}
	vs = append(vs, violation("path", ident.WorktreePath(r.GetPath()))...)
	if r.GetOffset() < 0 {
		vs = append(vs, session.Violation{Field: "offset", Description: "at least 0"})
	}
	if r.GetLength() < 0 || r.GetLength() > ident.MaxWorktreeRead {
		vs = append(vs, session.Violation{Field: "length", Description: "0 (1 MiB) to 1 MiB (1048576 bytes)"})
	}
	return session.Invalid(vs)
}

// validateWriteFiles checks a write batch: 1 to 100 files, 3 MiB of data
// in all (under gRPC's 4 MiB message bound, with room), each a worktree
// path and permission bits.
func validateWriteFiles(r *sessionv1.WriteWorktreeFilesRequest) ([]service.FileWrite, error) {
	vs := session.CheckID("session_id", r.GetSessionId())
	if n := len(r.GetFiles()); n == 0 || n > ident.MaxWorktreeWriteFiles {
		vs = append(vs, session.Violation{Field: "files", Description: "1 to 100 files"})
	}
	files := make([]service.FileWrite, 0, len(r.GetFiles()))
	total := 0
	for i, f := range r.GetFiles() {
		field := fmt.Sprintf("files[%d]", i)
		if f.GetPath() == "" {
			vs = append(vs, session.Violation{Field: field + ".path", Description: "a file relative to the worktree"})
		}
		vs = append(vs, violation(field+".path", ident.WorktreePath(f.GetPath()))...)
		if f.GetMode() > 0o777 {
			vs = append(vs, session.Violation{Field: field + ".mode", Description: "permission bits, at most 0o777 (0: keep, 0o644 when new)"})
		}
		total += len(f.GetData())
		files = append(files, service.FileWrite{Path: f.GetPath(), Data: f.GetData(), Mode: f.GetMode()})
	}
	if total > ident.MaxWorktreeWriteBytes {
		vs = append(vs, session.Violation{Field: "files", Description: "at most 3 MiB (3145728 bytes) of data in all"})
	}
	return files, session.Invalid(vs)
}

func violation(field, why string) []session.Violation {
	if why == "" {
		return nil
	}
	return []session.Violation{{Field: field, Description: why}}
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

// decodeToken reads a page token made by encodeToken.
func decodeToken(t string) (string, bool) {
	if len(t) > 1024 {
		return "", false
	}
	raw, err := base64.RawURLEncoding.DecodeString(t)
	return string(raw), err == nil
}
