package proxy

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

func TestValidateTitle(t *testing.T) {
	for _, tc := range []struct {
		t  TitleJSON
		ok bool
	}{
		{TitleJSON{Title: "Fix the flaky test", Version: 1}, true},
		{TitleJSON{Title: "Привет, 世界", Version: 7}, true},
		{TitleJSON{Title: strings.Repeat("é", 256), Version: 1}, true},
		{TitleJSON{Title: strings.Repeat("é", 257), Version: 1}, false},
		{TitleJSON{Title: "", Version: 1}, false},
		{TitleJSON{Title: "ok", Version: 0}, false},
		{TitleJSON{Title: "line\nbreak", Version: 1}, false},
		{TitleJSON{Title: "nul\x00", Version: 1}, false},
		{TitleJSON{Title: "bad \xff utf8", Version: 1}, false},
	} {
		if err := ValidateTitle(tc.t); (err == nil) != tc.ok {
			t.Errorf("ValidateTitle(%q, %d) = %v, want ok=%v", tc.t.Title, tc.t.Version, err, tc.ok)
		}
	}
}

// FuzzTitleBody decodes arbitrary bodies as the title route does: whatever
// passes validation is 1-256 runes of valid UTF-8 without control
// characters, with a version.
func FuzzTitleBody(f *testing.F) {
	for _, s := range []string{`{"title":"x","version":1}`, `{"title":"","version":1}`, `{"title":"a\u0000b","version":2}`, `{}`, `[`, `{"title":"\ud800","version":1}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var tj TitleJSON
		if json.Unmarshal(body, &tj) != nil || ValidateTitle(tj) != nil {
			return
		}
		n := utf8.RuneCountInString(tj.Title)
		if tj.Version == 0 || n < 1 || n > maxTitleRunes || !utf8.ValidString(tj.Title) || strings.ContainsFunc(tj.Title, unicode.IsControl) {
			t.Fatalf("accepted %q (version %d)", tj.Title, tj.Version)
		}
	})
}
