// Package worktree runs the wrapper's git steps on a route's workspace:
// clone at preparation, the change set after a turn, commit and push.
// Git reaches the repository only through the credential proxy's git route
// (<proxy_url>/git/<host>/<path>), and never holds a secret: the wrapper
// serves git a loopback relay for the length of one git command that adds
// the route's handle to each request (see relay.go), and the proxy adds
// the repository token. Nothing git writes (.git/config, the environment,
// argv) carries the handle or the token.
package worktree

import "agentplane.dev/pkg/gitrepo"

// Repo is a parsed repository URL.
type Repo = gitrepo.Repo

// ErrBadRepoURL is a repository URL the git route cannot serve.
var ErrBadRepoURL = gitrepo.ErrBadRepoURL

// ParseRepoURL checks a repository URL (gitrepo.Parse).
func ParseRepoURL(raw string) (Repo, error) { return gitrepo.Parse(raw) }
