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
