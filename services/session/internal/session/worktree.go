package session

import (
	"errors"
	"fmt"
	"strings"
	"unicode"

	"agentplane.dev/pkg/gitrepo"
	"agentplane.dev/pkg/ident"
)

// ErrNoRepository: a push for a session without a repository.
var ErrNoRepository = errors.New("the session names no repository")

// WorktreeError is a worktree action the sandbox refused, with its reason
// (WORKTREE_UNAVAILABLE, PUSH_REJECTED, REPO_AUTH_FAILED, ...).
type WorktreeError struct {
	Reason, Detail string
	Retryable      bool
}

func (e *WorktreeError) Error() string { return "worktree: " + e.Reason + ": " + e.Detail }

// Bounds of the worktree fields.
const (
	MaxRefLen        = 255
	MaxDepth         = 1 << 20
	MaxBranchLen     = 200
	MaxCommitMessage = 64 << 10
)

// CheckCloneURL checks a repository URL the git route can clone: http(s),
// no credentials, query or fragment (gitrepo.Parse).
func CheckCloneURL(field, v string) []Violation {
	if v == "" {
		return nil
	}
	if _, err := gitrepo.Parse(v); err != nil {
		return []Violation{{field, "an http(s) repository URL without credentials, query or fragment"}}
	}
	return nil
}

// CheckPushPrefix checks an optional push branch prefix by the rule the
// credential service's git route enforces (gitrepo.ValidPushPrefix).
func CheckPushPrefix(field, v string) []Violation {
	if !gitrepo.ValidPushPrefix(v) {
		return []Violation{{field, gitrepo.PushPrefixRule}}
	}
	return nil
}

// PushBranchPrefix is the branch prefix the git route confines the
// session's pushes to: the one asked, else the default; "" without a
// repository (no git route).
func (s *Session) PushBranchPrefix() string {
	switch {
	case s.RepoURL == "":
		return ""
	case s.PushPrefix == "":
		return gitrepo.DefaultPushBranchPrefix
	}
	return s.PushPrefix
}

// CheckRef checks an optional branch, tag or commit name.
func CheckRef(field, v string) []Violation {
	switch {
	case len(v) > MaxRefLen:
		return []Violation{{field, fmt.Sprintf("at most %d bytes", MaxRefLen)}}
	case strings.HasPrefix(v, "-") || strings.Contains(v, "..") || strings.ContainsFunc(v, func(r rune) bool {
		return unicode.IsSpace(r) || unicode.IsControl(r) || strings.ContainsRune("~^:?*[\\", r)
	}):
		return []Violation{{field, "a git branch, tag or commit name"}}
	}
	return nil
}

// CheckBranch checks a push branch (git's rules, roughly; the wrapper asks
// git itself too).
func CheckBranch(field, v string) []Violation {
	switch {
	case v == "":
		return []Violation{{field, "required"}}
	case len(v) > MaxBranchLen:
		return []Violation{{field, fmt.Sprintf("at most %d bytes", MaxBranchLen)}}
	case strings.HasPrefix(v, "refs/"), strings.HasSuffix(v, "/"), strings.HasSuffix(v, ".lock"), strings.Contains(v, "//"),
		strings.Contains(v, "@{"), v == "@", len(CheckRef(field, v)) > 0:
		return []Violation{{field, "a git branch name (without refs/heads/)"}}
	}
	return nil
}

// CheckAuthorName checks an optional commit author name (ident.AuthorName).
func CheckAuthorName(field, v string) []Violation { return violation(field, ident.AuthorName(v)) }

// CheckAuthorEmail checks an optional commit author email (ident.AuthorEmail).
func CheckAuthorEmail(field, v string) []Violation { return violation(field, ident.AuthorEmail(v)) }

// CheckCommitMessage checks a commit message.
func CheckCommitMessage(field, v string) []Violation {
	switch {
	case strings.TrimSpace(v) == "":
		return []Violation{{field, "required"}}
	case len(v) > MaxCommitMessage:
		return []Violation{{field, fmt.Sprintf("at most %d bytes", MaxCommitMessage)}}
	}
	return nil
}
