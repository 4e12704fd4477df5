package worktree

import (
	"errors"
	"strings"
)

// Route failure reasons of preparation (lower snake, as RouteFailed
// carries them; docs/errors.md lists their UPPER_SNAKE names).
const (
	ReasonRepoUnreachable = "repo_unreachable"
	ReasonRepoAuthFailed  = "repo_auth_failed"
	ReasonRefNotFound     = "ref_not_found"
	ReasonRepoTooLarge    = "repo_too_large"
	// ReasonNoSpace is ENOSPC evidence: the sandbox service recovers the
	// sandbox (DESIGN.md 3.4).
	ReasonNoSpace    = "workspace_no_space"
	ReasonBadRepoURL = "bad_repo_url"
	ReasonCloneFail  = "clone_failed"
)

// Push and report failure reasons (UPPER_SNAKE, as gRPC ErrorInfo).
const (
	PushRejected        = "PUSH_REJECTED"
	PushAuthFailed      = "REPO_AUTH_FAILED"
	PushUnreachable     = "REPO_UNREACHABLE"
	WorktreeUnavailable = "WORKTREE_UNAVAILABLE"
	InvalidBranch       = "INVALID_BRANCH"
)

// Failure is a git step that failed for a named reason. Detail never
// carries a secret (git never sees one) and is bounded.
type Failure struct {
	Reason    string
	Detail    string
	Retryable bool
}

func (f *Failure) Error() string { return "worktree: " + f.Reason + ": " + f.Detail }

// AsFailure returns err's Failure, or a generic one of reason.
func AsFailure(err error, reason string) *Failure {
	var f *Failure
	if errors.As(err, &f) {
		return f
	}
	return &Failure{Reason: reason, Detail: "git step failed", Retryable: true}
}

// classifyFetch names why a clone or fetch failed from git's stderr
// (LC_ALL=C). The proxy answers 403 for what the git route does not admit,
// the upstream 401/403 for a wrong token, and 502 for an upstream it
// cannot reach.
func classifyFetch(stderr string) *Failure {
	s := strings.ToLower(stderr)
	detail := lastLine(stderr)
	switch {
	case strings.Contains(s, "no space left on device"):
		return &Failure{Reason: ReasonNoSpace, Detail: "no space left on device", Retryable: true}
	case strings.Contains(s, "remote branch") && strings.Contains(s, "not found"),
		strings.Contains(s, "did not match any"), strings.Contains(s, "reference is not a tree"),
		strings.Contains(s, "couldn't find remote ref"), strings.Contains(s, "unknown revision"):
		return &Failure{Reason: ReasonRefNotFound, Detail: detail}
	case strings.Contains(s, "error: 401"), strings.Contains(s, "error: 403"),
		strings.Contains(s, "authentication failed"), strings.Contains(s, "could not read username"),
		strings.Contains(s, "could not read password"):
		return &Failure{Reason: ReasonRepoAuthFailed, Detail: detail}
	case strings.Contains(s, "error: 404"), strings.Contains(s, "not found"),
		strings.Contains(s, "error: 502"), strings.Contains(s, "error: 503"), strings.Contains(s, "error: 504"),
		strings.Contains(s, "unable to access"), strings.Contains(s, "could not resolve"),
		strings.Contains(s, "failed to connect"), strings.Contains(s, "connection refused"):
		return &Failure{Reason: ReasonRepoUnreachable, Detail: detail, Retryable: true}
	}
	return &Failure{Reason: ReasonCloneFail, Detail: detail, Retryable: true}
}

// classifyPush names why a push failed.
func classifyPush(output string) *Failure {
	s := strings.ToLower(output)
	detail := rejectionLine(output)
	switch {
	case strings.Contains(s, "[rejected]"), strings.Contains(s, "[remote rejected]"), strings.Contains(s, "non-fast-forward"),
		strings.Contains(s, "fetch first"), strings.Contains(s, "error: 403"):
		return &Failure{Reason: PushRejected, Detail: detail}
	case strings.Contains(s, "error: 401"), strings.Contains(s, "authentication failed"), strings.Contains(s, "could not read username"):
		return &Failure{Reason: PushAuthFailed, Detail: detail}
	case strings.Contains(s, "unable to access"), strings.Contains(s, "error: 404"), strings.Contains(s, "error: 502"),
		strings.Contains(s, "error: 503"), strings.Contains(s, "failed to connect"):
		return &Failure{Reason: PushUnreachable, Detail: detail, Retryable: true}
	}
	return &Failure{Reason: PushRejected, Detail: detail}
}

// rejectionLine is the line in which git reports why the remote refused a
// ref (" ! [remote rejected] agent/x -> main (agentplane: ...)": the git
// route's reason), or the last line when there is none: the caller should
// read the reason, not git's closing "failed to push some refs".
func rejectionLine(s string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, "[remote rejected]") || strings.Contains(l, "[rejected]") {
			return lastLine(l)
		}
	}
	return lastLine(s)
}

// lastLine is the last non-empty line of git's output, bounded, with the
// relay's ephemeral URL left as is (it names no secret).
func lastLine(s string) string {
	lines := strings.FieldsFunc(s, func(r rune) bool { return r == '\n' || r == '\r' })
	for i := len(lines) - 1; i >= 0; i-- {
		if l := strings.TrimSpace(lines[i]); l != "" {
			if len(l) > 300 {
				l = l[:300]
			}
			return l
		}
	}
	return "git failed"
}
