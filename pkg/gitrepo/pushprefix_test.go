package gitrepo

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestValidPushPrefix(t *testing.T) {
	for s, want := range map[string]bool{
		"": true, "agent/": true, "team/bot/": true, strings.Repeat("a", 99) + "/": true,
		"bot": false, "/": false, "a//": false, "/a/": false, "../": false, ".x/": false, "a.lock/": false,
		"a./": false, "a@{/": false, "a b/": false, "a~/": false, "a:/": false, "a\x7f/": false, "a\n/": false,
		strings.Repeat("a", 100) + "/": false,
	} {
		require.Equal(t, want, ValidPushPrefix(s), "%q", s)
	}
}

func TestSafeRefName(t *testing.T) {
	for ref, want := range map[string]bool{
		"refs/heads/agent/x": true, "refs/heads/agent/x.y": true,
		"refs/heads/agent/../main": false, "refs/heads/agent/.x": false, "refs/heads/agent/x.lock": false,
		"refs/heads/agent/x@{1}": false, "refs/heads/agent//x": false, "refs/heads/a b": false, "@": false,
	} {
		require.Equal(t, want, SafeRefName(ref), "%q", ref)
	}
}

// FuzzValidPushPrefix: an admitted prefix is "" or a short ref path ending
// in "/", so no branch it admits is the bare default branch, and no
// component git would read as a parent or a reflog.
func FuzzValidPushPrefix(f *testing.F) {
	for _, s := range []string{"", "agent/", "team/bot/", "main", "../x/", "a//", ".x/", "a.lock/", "a b/", "@{/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !ValidPushPrefix(s) || s == "" {
			return
		}
		if !strings.HasSuffix(s, "/") || len(s) > MaxPushPrefixBytes || strings.Contains(s, "..") || strings.Contains(s, "//") ||
			strings.Contains(s, "@{") || strings.ContainsAny(s, " ~^:?*[\\\x00") || strings.HasPrefix(s, "/") {
			t.Fatalf("admitted %q", s)
		}
	})
}
