package history

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var jsonSeeds = []string{
	``, ` `, `{}`, `[]`, `{"a":1}`, `{"a":[1,2,{"b":null}],"c":true,"d":false}`, `"x"`, ` 1 `,
	`-0`, `-0.5e+10`, `01`, `1.`, `1e`, `.5`, `-`, `+1`, `"\u00e9\n\"\\\/"`, `"\x"`, `"\u12g4"`,
	"\"\x01\"", "\"\xff\xfe\"", `{"a" 1}`, `{"a":1,}`, `[1,]`, `[1 2]`, `{1:2}`, `[`, `]`, `{"a":}`,
	`tru`, `nul`, `falsey`, `true false`, `{"a":1}}`, `[[[]]]`, "\t[\r\n]\n", `{"":""}`, `[{}]`,
	strings.Repeat("[", 10000) + strings.Repeat("]", 10000),
	strings.Repeat("[", 10001) + strings.Repeat("]", 10001),
	strings.Repeat(`{"a":`, 10000) + "1" + strings.Repeat("}", 10000),
	strings.Repeat(`{"a":`, 10001) + "1" + strings.Repeat("}", 10001),
	strings.Repeat("[", 10001),
}

func TestValidJSONMatchesEncodingJSON(t *testing.T) {
	for _, s := range jsonSeeds {
		require.Equal(t, json.Valid([]byte(s)), validJSON([]byte(s)), "%.40q", s)
	}
}

// Strings are scanned eight bytes at a time: every special byte at every position of a
// word, and strings ending at every position, must be judged as encoding/json does.
func TestValidJSONLongStrings(t *testing.T) {
	specials := []string{`"`, `\`, `\"`, `\n`, `\u00e9`, `\x`, `\u12g4`, "\x00", "\x01", "\x1f", " ", "\x7f", "\x80", "\xff", "\xe9"}
	for n := range 20 {
		for _, sp := range specials {
			for _, s := range []string{
				`"` + strings.Repeat("a", n) + sp + strings.Repeat("b", 17) + `"`,
				`["` + strings.Repeat("a", n) + sp + `"]`,
				`"` + strings.Repeat("a", n) + sp,
			} {
				require.Equal(t, json.Valid([]byte(s)), validJSON([]byte(s)), "%q", s)
			}
		}
	}
}

// FuzzValidJSON checks that validJSON accepts exactly what encoding/json.Valid accepts.
func FuzzValidJSON(f *testing.F) {
	for _, s := range jsonSeeds {
		if len(s) < 200 {
			f.Add([]byte(s))
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if json.Valid(b) != validJSON(b) {
			t.Fatalf("json.Valid=%v validJSON=%v for %q", json.Valid(b), validJSON(b), b)
		}
	})
}

func BenchmarkValidJSON(b *testing.B) {
	payload := []byte(`{"text":"` + strings.Repeat("x", 1013) + `","n":[1,2.5,-3e4],"ok":true}`)
	b.Run("impl=encoding-json", func(b *testing.B) {
		for b.Loop() {
			json.Valid(payload)
		}
	})
	b.Run("impl=validJSON", func(b *testing.B) {
		for b.Loop() {
			validJSON(payload)
		}
	})
}
