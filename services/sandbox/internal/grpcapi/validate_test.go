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
