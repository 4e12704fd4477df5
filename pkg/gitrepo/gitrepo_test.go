package gitrepo

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	r, err := Parse("https://Git.Example.com:8443/org/repo.git")
	require.NoError(t, err)
	require.Equal(t, Repo{Scheme: "https", Host: "git.example.com:8443", Path: "/org/repo.git"}, r)
	for _, bad := range []string{"", "ssh://h/r", "https://u:p@h/r", "https://h", "https://h/", "https://h/a/../b", "https://h/a?x=1",
		"https://h/a#f", "https://h/a%2fb", "https://h//a", "file:///etc", "https://h/a b"} {
		_, err := Parse(bad)
		require.ErrorIs(t, err, ErrBadRepoURL, bad)
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{"https://h/o/r.git", "http://127.0.0.1:9/r", "https://u@h/r", "https://h/a/../b", "https://h/%2e%2e/x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := Parse(s)
		if err != nil {
			return
		}
		p := r.ProxyPath()
		if strings.Contains(p, "..") || strings.Contains(p, "//") || strings.Contains(p, "\\") || strings.Contains(p, "@") || strings.Contains(p, "?") {
			t.Fatalf("unsafe proxy path %q from %q", p, s)
		}
	})
}
