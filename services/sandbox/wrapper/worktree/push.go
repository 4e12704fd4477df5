package worktree

import (
	"context"
	"strings"
)

// PushSpec is a commit-and-push of a route's worktree.
type PushSpec struct {
	Dir, RepoURL, ProxyURL string
	Handle                 func() string
	Branch, Message        string
	// The commit's author; empty: the agentplane identity, which is the
	// committer either way.
	AuthorName, AuthorEmail string
}

// PushResult is what was pushed.
type PushResult struct {
	Commit, Ref string
	Committed   bool
}

// ValidBranch checks a branch name the way git does.
func ValidBranch(ctx context.Context, name string) bool {
	if name == "" || len(name) > 200 || strings.HasPrefix(name, "-") {
		return false
	}
	return gitCmd(ctx, "", gitEnv(), "check-ref-format", "--branch", name).Run() == nil
}

// Push commits every change of the worktree (authored by the spec's author,
// committed by the agentplane identity) and pushes HEAD to refs/heads/<branch> of the route's repository through
// the proxy. With nothing to commit, HEAD is pushed as it is.
func Push(ctx context.Context, s PushSpec) (PushResult, error) {
	defer lockDir(s.Dir)()
	if !IsRepository(s.Dir) {
		return PushResult{}, &Failure{Reason: WorktreeUnavailable, Detail: "the workspace is not a git checkout"}
	}
	if !ValidBranch(ctx, s.Branch) {
		return PushResult{}, &Failure{Reason: InvalidBranch, Detail: "not a valid branch name"}
	}
	repo, err := ParseRepoURL(s.RepoURL)
	if err != nil {
		return PushResult{}, &Failure{Reason: WorktreeUnavailable, Detail: "the session has no pushable repository"}
	}
	if _, e, err := git(ctx, s.Dir, nil, "add", "-A", "--", "."); err != nil {
		return PushResult{}, &Failure{Reason: PushRejected, Detail: lastLine(e)}
	}
	res := PushResult{Ref: "refs/heads/" + s.Branch}
	if _, _, err := git(ctx, s.Dir, nil, "diff", "--cached", "--quiet"); err != nil {
		args := append(append([]string{}, identity...), "commit", "--quiet", "--no-verify", "-F", "-")
		if _, e, err := gitWith(ctx, s.Dir, authorEnv(s.AuthorName, s.AuthorEmail), strings.NewReader(s.Message), args...); err != nil {
			return PushResult{}, &Failure{Reason: PushRejected, Detail: "commit failed: " + lastLine(e)}
		}
		res.Committed = true
	}
	head, _, err := git(ctx, s.Dir, nil, "rev-parse", "--verify", "HEAD")
	if err != nil {
		return PushResult{}, &Failure{Reason: PushRejected, Detail: "nothing to push: the worktree has no commit"}
	}
	res.Commit = trim(head)
	rl, err := startRelay(s.ProxyURL, repo, s.Handle)
	if err != nil {
		return PushResult{}, &Failure{Reason: PushUnreachable, Detail: "the credential proxy is not configured"}
	}
	defer rl.close()
	out, e, err := git(ctx, s.Dir, nil, "push", "--porcelain", "--no-verify", rl.url(repo), "HEAD:"+res.Ref)
	if err != nil {
		return PushResult{}, classifyPush(out + "\n" + e)
	}
	return res, nil
}

// authorEnv sets the commit's author through git's environment (never a
// shell or the command line); an empty part keeps identity's.
func authorEnv(name, email string) []string {
	var env []string
	if name != "" {
		env = append(env, "GIT_AUTHOR_NAME="+name)
	}
	if email != "" {
		env = append(env, "GIT_AUTHOR_EMAIL="+email)
	}
	return env
}
