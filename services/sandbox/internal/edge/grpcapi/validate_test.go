package grpcapi

import (
	"path"
	"strings"
	"testing"

	"agentplane.dev/pkg/ident"
)

func FuzzValidDirectory(f *testing.F) {
	for _, s := range []string{"/repo/a", "/", "relative", "/a/../b", "/a//b", "/a\\b", "/a/\x00", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, d string) {
		if !validDirectory(d) {
			return
		}
		if !strings.HasPrefix(d, "/") || path.Clean(d) != d || strings.Contains(d, "..") && path.Clean(d) != d {
			t.Fatalf("accepted %q", d)
		}
	})
}

func FuzzValidID(f *testing.F) {
	for _, s := range []string{"s1", "sb-x.y:z", "{tag}", "", "a b", strings.Repeat("a", 129)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		if validID(id) && (strings.ContainsAny(id, "{} /.\x00") || len(id) > ident.MaxIDLen || id == "") {
			t.Fatalf("accepted %q", id)
		}
	})
}

// Issue 18 item 5: sandbox ids shaped like another key, fence resource or a
// path are refused.
func TestSandboxIDsThatCouldCollideAreRefused(t *testing.T) {
	for _, ok := range []string{"sbx-0123abcd", "sb_1", "A-b_9"} {
		if !validSandboxID(ok) {
			t.Errorf("refused %q", ok)
		}
	}
	for _, bad := range []string{"", "..", ".", "cs:abc", "ses/s1", "sbx/x", "a{b}", "a b", "a.b", strings.Repeat("a", 65)} {
		if validSandboxID(bad) {
			t.Errorf("accepted %q", bad)
		}
	}
}

func FuzzValidSandboxID(f *testing.F) {
	for _, s := range []string{"sbx-1", "..", "cs:x", "ses/a", "{t}", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		if validSandboxID(id) && (strings.ContainsAny(id, "{}:/. \x00") || len(id) > maxSandboxID || id == "") {
			t.Fatalf("accepted %q", id)
		}
	})
}
