package proxy

import "testing"

func TestRouteLabel(t *testing.T) {
	for path, want := range map[string]string{
		"/s/sbx-1/provider/v1/chat/completions": "provider",
		"/s/sbx-1/backend/x":                    "backend",
		"/s/sbx-1/ingest/v1/sessions/a/items":   "ingest",
		"/s/sbx-1/git/info/refs":                "git",
		"/s/sbx-1/other/x":                      "unknown",
		"/s/sbx-1":                              "unknown",
		"/provider/v1":                          "unknown",
		"":                                      "unknown",
	} {
		if got := routeLabel(path); got != want {
			t.Errorf("routeLabel(%q) = %q, want %q", path, got, want)
		}
	}
}

// FuzzRouteLabel: whatever path a caller sends, the label is one of five values (a
// bounded metric label and span name).
func FuzzRouteLabel(f *testing.F) {
	for _, s := range []string{"/s/a/provider/x", "/s//ingest", "/s/a/b/c", "/%2e%2e/", "/s/\x00/backend"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, path string) {
		switch got := routeLabel(path); got {
		case "provider", "backend", "ingest", "git", "unknown":
		default:
			t.Fatalf("routeLabel(%q) = %q", path, got)
		}
	})
}
