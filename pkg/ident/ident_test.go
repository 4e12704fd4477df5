package ident

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestID(t *testing.T) {
	for _, ok := range []string{"s1", "sbx-a", "rs_0123abcd", "cr_AbC-9_x", strings.Repeat("a", MaxIDLen)} {
		require.Empty(t, ID(ok), ok)
	}
	for _, bad := range []string{"", "..", ".", "s/..", "../x", "a.b", "a:b", "{x}", "a b", "é", strings.Repeat("a", MaxIDLen+1)} {
		require.NotEmpty(t, ID(bad), bad)
	}
	require.Empty(t, OptionalID(""))
	require.NotEmpty(t, OptionalID(".."))
}

func TestDirectory(t *testing.T) {
	for _, ok := range []string{"/w/repo", "/work/a b", "/x"} {
		require.Empty(t, Directory(ok), ok)
	}
	for _, bad := range []string{"", "/", "../x", "x", "/w/../x", "/w/./x", "/w//x", "/w/", "/w\\x", "/w\x00", "/w\xff", "/" + strings.Repeat("a", MaxDirectoryLen)} {
		require.NotEmpty(t, Directory(bad), bad)
	}
}

func FuzzID(f *testing.F) {
	for _, s := range []string{"s1", "..", "s/..", "a\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if ID(s) == "" && (strings.ContainsAny(s, "./\\:{}") || s == "" || len(s) > MaxIDLen) {
			t.Fatalf("admitted %q", s)
		}
	})
}

func TestReservedDirectory(t *testing.T) {
	for _, ok := range []string{"/w/repo", "/work/e2e", "/home/u/repo", "/tmp/repo", "/usrx", "/procs/x", "/var/lib/x", "/root/x", "/srv/a/b", "/agentplanex"} {
		require.Empty(t, ReservedDirectory(ok), ok)
	}
	for _, bad := range []string{"/proc", "/proc/1", "/usr", "/usr/local/src", "/etc", "/etc/x", "/tmp", "/run", "/run/agentplane",
		"/dev/shm/x", "/sys/fs", "/bin", "/lib64/x", "/sbin", "/agentplane", "/agentplane/home/x"} {
		require.NotEmpty(t, ReservedDirectory(bad), bad)
	}
}

func TestWorktreePath(t *testing.T) {
	for _, ok := range []string{"", ".", "a", "a/b", "a..b", "..a", ".git/config", "a/./b"} {
		require.Empty(t, WorktreePath(ok), ok)
	}
	for _, bad := range []string{"/a", "/", "..", "a/..", "a/../b", "../x", "a\x00b", strings.Repeat("x", MaxWorktreePath+1)} {
		require.NotEmpty(t, WorktreePath(bad), bad)
	}
}

// FuzzAuthorAndPath: what the author and worktree-path rules admit never
// carries what git or the wrapper would read as more than it is.
func FuzzAuthorAndPath(f *testing.F) {
	for _, s := range []string{"Ada Lovelace", "ada@example.com", "a\nb", "x<y>", "src/main.go", "../etc", "a/../../b", "/abs", "a\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if AuthorName(s) == "" && (len(s) > MaxAuthorLen || strings.ContainsAny(s, "<>\n\r\x00")) {
			t.Fatalf("author name admitted %q", s)
		}
		if AuthorEmail(s) == "" && s != "" && (strings.Count(s, "@") != 1 || strings.ContainsAny(s, " <>\n\t\x00")) {
			t.Fatalf("author email admitted %q", s)
		}
		if WorktreePath(s) == "" && (strings.HasPrefix(s, "/") || strings.Contains("/"+s+"/", "/../") || strings.ContainsRune(s, 0) || len(s) > MaxWorktreePath) {
			t.Fatalf("worktree path admitted %q", s)
		}
	})
}
