package usage

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzReader feeds arbitrary response bodies, whole and split at an
// arbitrary point and byte by byte: the result never depends on the split,
// and for a JSON body it agrees with encoding/json (where the reader's
// bounds do not apply).
func FuzzReader(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","usage":{"prompt_tokens":12,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":4}}}`,
		`{"response":{"model":"o3","usage":{"input_tokens":7}}}`,
		"data: {\"model\":\"m\",\"usage\":{\"prompt_tokens\":1}}\r\n\r\ndata: [DONE]\n\n",
		`{"a":[1,2,{"b":"\"}"}],"usage":{"completion_tokens":1e3}}`,
		`[]`, `"x"`, `{"usage":{}}`, "",
	} {
		f.Add([]byte(s), uint16(3))
	}
	f.Fuzz(func(t *testing.T, body []byte, split uint16) {
		for _, format := range []Format{JSON, SSE} {
			whole := readAll(format, string(body), 0)
			at := int(split) % (len(body) + 1)
			r := NewReader(format)
			_, _ = r.Write(body[:at])
			_, _ = r.Write(body[at:])
			require.Equal(t, whole, r.Usage(), "split at %d", at)
			if len(body) < 512 {
				require.Equal(t, whole, readAll(format, string(body), 1), "byte by byte")
			}
			require.LessOrEqual(t, len(whole.Model), MaxModel)
		}
		if want, ok := oracle(body); ok {
			require.Equal(t, want, readAll(JSON, string(body), 0))
		}
	})
}

// oracle reads a JSON body with encoding/json, for bodies within the
// reader's bounds and without escapes (the reader matches keys verbatim).
func oracle(body []byte) (Usage, bool) {
	if bytes.ContainsAny(body, "\\") || bytes.Count(body, []byte("{"))+bytes.Count(body, []byte("[")) > maxDepth/2 || !json.Valid(body) {
		return Usage{}, false
	}
	d := json.NewDecoder(bytes.NewReader(body))
	d.UseNumber()
	var top any
	if d.Decode(&top) != nil {
		return Usage{}, false
	}
	var u Usage
	obj, _ := top.(map[string]any)
	read := func(o map[string]any) {
		if m, ok := o["model"].(string); ok {
			if m = cleanModel([]byte(m)); m != "" {
				u.Model = m
			}
		}
		us, _ := o["usage"].(map[string]any)
		num := func(v any) (uint64, bool) {
			n, ok := v.(json.Number)
			if !ok {
				return 0, false
			}
			c, err := strconv.ParseUint(string(n), 10, 64)
			return c, err == nil && c <= maxCount
		}
		for k, v := range us {
			n, ok := num(v)
			switch {
			case !ok:
			case k == "prompt_tokens" || k == "input_tokens":
				u.Input, u.Found = n, true
			case k == "completion_tokens" || k == "output_tokens":
				u.Output, u.Found = n, true
			}
		}
		for _, k := range []string{"prompt_tokens_details", "input_tokens_details"} {
			if det, ok := us[k].(map[string]any); ok {
				if n, ok := num(det["cached_tokens"]); ok {
					u.Cached, u.Found = n, true
				}
			}
		}
	}
	if obj == nil {
		return u, true
	}
	// Duplicate keys and both spellings make the order of reads matter
	// (the reader takes the last in the body): leave those to the split
	// property.
	for _, dup := range []string{`"model"`, `"usage"`, `"response"`, `tokens"`, `_details"`} {
		if bytes.Count(body, []byte(dup)) > 1 && dup != `tokens"` || strings.Count(string(body), `_tokens"`) > 3 {
			return Usage{}, false
		}
	}
	if r, ok := obj["response"].(map[string]any); ok {
		read(r)
	}
	read(obj)
	return u, true
}

// FuzzAskForUsage: a body the reader changes is still JSON, with
// stream_options.include_usage true and every member of the caller's
// unchanged.
func FuzzAskForUsage(f *testing.F) {
	for _, s := range []string{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`,
		`{"stream":true,"stream_options":{}}`, ` {"stream" :true}`, `{"stream":true,"x":{"stream":false}}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req := ParseRequest(body)
		out, changed := AskForUsage(body, req)
		if !changed {
			require.Equal(t, body, out)
			return
		}
		require.True(t, json.Valid(body), "only JSON is changed")
		var before, after map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(body, &before))
		require.NoError(t, json.Unmarshal(out, &after))
		require.JSONEq(t, `{"include_usage":true}`, string(after["stream_options"]))
		_, had := before["stream_options"]
		require.False(t, had)
		delete(after, "stream_options")
		require.Equal(t, before, after)
	})
}
