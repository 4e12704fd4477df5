package proxy

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/gitrepo"
)

func TestMatchGit(t *testing.T) {
	repo, err := gitrepo.Parse("https://git.example.com:8443/org/app.git")
	require.NoError(t, err)
	split := func(p string) []string { return strings.Split(p, "/") }
	cases := []struct {
		rest, method, query, reason string
	}{
		{"git.example.com:8443/org/app.git/info/refs", "GET", "service=git-upload-pack", ""},
		{"GIT.example.com:8443/org/app.git/info/refs", "GET", "service=git-receive-pack", ""},
		{"git.example.com:8443/org/app.git/git-upload-pack", "POST", "", ""},
		{"git.example.com:8443/org/app.git/git-receive-pack", "POST", "", ""},
		{"git.example.com:8443/org/other.git/git-receive-pack", "POST", "", "git_repo_denied"},
		{"git.example.com:8443/org/other.git/info/refs", "GET", "service=git-upload-pack", "git_repo_denied"},
		{"evil.example.com:8443/org/app.git/info/refs", "GET", "service=git-upload-pack", "git_repo_denied"},
		{"git.example.com/org/app.git/info/refs", "GET", "service=git-upload-pack", "git_repo_denied"},
		{"git.example.com:8443/org/app.git", "GET", "", "git_repo_denied"},
		{"git.example.com:8443/org/app.git/info/refs", "POST", "service=git-upload-pack", "method_not_allowed"},
		{"git.example.com:8443/org/app.git/git-upload-pack", "GET", "", "method_not_allowed"},
		{"git.example.com:8443/org/app.git/info/refs", "GET", "", "git_endpoint_denied"},
		{"git.example.com:8443/org/app.git/info/refs", "GET", "service=git-upload-pack&x=1", "git_endpoint_denied"},
		{"git.example.com:8443/org/app.git/objects/info/packs", "GET", "", "git_endpoint_denied"},
		{"git.example.com:8443/org/app.git/HEAD", "GET", "", "git_endpoint_denied"},
		{"git.example.com:8443/org/app.git/git-upload-pack", "POST", "x=1", "git_endpoint_denied"},
		{"git.example.com:8443/org", "GET", "", "git_repo_denied"},
	}
	for _, c := range cases {
		_, reason := matchGit(split(c.rest), repo, c.method, c.query)
		require.Equal(t, c.reason, reason, "%s %s?%s", c.method, c.rest, c.query)
	}
}

// FuzzGitTarget: whatever the request path, an admitted one names exactly
// the member's repository and one smart-HTTP endpoint.
func FuzzGitTarget(f *testing.F) {
	for _, s := range []string{
		"/s/sb/git/h:1/o/r.git/info/refs?service=git-upload-pack", "/s/sb/git/h:1/o/r.git/git-receive-pack",
		"/s/sb/git/h:1/o/r.git/../x/git-upload-pack", "/s/sb/git/h:1/o/r.git%2fx/git-upload-pack", "/s/sb/git/h:1/o//r.git/info/refs",
	} {
		f.Add(s, "GET")
		f.Add(s, "POST")
	}
	repo, _ := gitrepo.Parse("http://h:1/o/r.git")
	f.Fuzz(func(t *testing.T, uri, method string) {
		tg, err := ParseTarget(uri)
		if err != nil || tg.Route != RouteGit {
			return
		}
		e, reason := matchGit(tg.Rest, repo, method, tg.RawQuery)
		if reason != "" {
			return
		}
		path := "/" + strings.Join(tg.Rest[1:], "/")
		if !strings.HasPrefix(path, "/o/r.git/") || e == nil || path != "/o/r.git/"+strings.Join(e.suffix, "/") {
			t.Fatalf("admitted %q %q as %q", method, uri, path)
		}
	})
}
