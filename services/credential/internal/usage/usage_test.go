package usage

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// readAll feeds body to a reader in chunks of n bytes (0: at once).
func readAll(f Format, body string, n int) Usage {
	r := NewReader(f)
	b := []byte(body)
	if n <= 0 {
		n = len(b) + 1
	}
	for len(b) > 0 {
		k := min(n, len(b))
		_, _ = r.Write(b[:k])
		b = b[k:]
	}
	return r.Usage()
}

func TestReaderJSON(t *testing.T) {
	cases := []struct {
		name, body string
		want       Usage
	}{
		{"chat completion", `{"id":"x","model":"gpt-4o","choices":[{"message":{"content":"hi \"usage\":{\"prompt_tokens\":9}"}}],` +
			`"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":4}}}`,
			Usage{Model: "gpt-4o", Input: 12, Output: 5, Cached: 4, Found: true}},
		{"usage before model", `{"usage":{"completion_tokens":3},"model":"m1"}`, Usage{Model: "m1", Output: 3, Found: true}},
		{"responses API", `{"object":"response","model":"o3","usage":{"input_tokens":7,"output_tokens":2,"input_tokens_details":{"cached_tokens":1}}}`,
			Usage{Model: "o3", Input: 7, Output: 2, Cached: 1, Found: true}},
		{"nested usage is not the response's", `{"model":"m","choices":[{"usage":{"prompt_tokens":9}}],"data":{"usage":{"prompt_tokens":9}}}`,
			Usage{Model: "m"}},
		{"no usage", `{"model":"m","choices":[]}`, Usage{Model: "m"}},
		{"usage null", `{"model":"m","usage":null}`, Usage{Model: "m"}},
		{"negative, fractional and huge counts are not counted", `{"usage":{"prompt_tokens":-1,"completion_tokens":1.5,"prompt_tokens_details":{"cached_tokens":99999999999999999999}}}`,
			Usage{}},
		{"truncated body", `{"model":"m","usage":{"prompt_tokens":12`, Usage{Model: "m"}},
		{"trailing garbage", `{"usage":{"prompt_tokens":12}} x`, Usage{}},
		{"implausible model", `{"model":"a b\u0000","usage":{"prompt_tokens":1}}`, Usage{Input: 1, Found: true}},
		{"overlong model", `{"model":"` + strings.Repeat("m", MaxModel+1) + `","usage":{"prompt_tokens":1}}`, Usage{Input: 1, Found: true}},
		{"not JSON", `<html>`, Usage{}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, n := range []int{0, 1, 2, 7} {
				require.Equal(t, c.want, readAll(JSON, c.body, n), "chunks of %d", n)
			}
		})
	}
}

func TestReaderSSE(t *testing.T) {
	chunk := func(s string) string { return "data: " + s + "\n\n" }
	stream := chunk(`{"model":"m-1","choices":[{"delta":{"content":"a"}}],"usage":null}`) +
		": keep-alive\n\n" +
		"event: x\nid: 3\n" + chunk(`{"model":"m-1","choices":[{"delta":{},"finish_reason":"stop"}]}`) +
		chunk(`{"model":"m-1","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":2}}}`) +
		chunk("[DONE]")
	want := Usage{Model: "m-1", Input: 10, Output: 5, Cached: 2, Found: true}
	for _, n := range []int{0, 1, 3, 64} {
		require.Equal(t, want, readAll(SSE, stream, n), "chunks of %d", n)
		require.Equal(t, want, readAll(SSE, strings.ReplaceAll(stream, "\n", "\r\n"), n), "CRLF, chunks of %d", n)
		require.Equal(t, want, readAll(SSE, strings.ReplaceAll(stream, "\n", "\r"), n), "CR, chunks of %d", n)
	}
	// The last event with usage wins; data lines of one event join.
	multi := "data: {\"usage\":{\"prompt_tokens\":1}}\n\ndata: {\"usage\":\ndata: {\"prompt_tokens\":3}}\n\n"
	require.Equal(t, Usage{Input: 3, Found: true}, readAll(SSE, multi, 1))
	// A stream cut after its usage event (no final blank line) still counts.
	require.Equal(t, Usage{Input: 4, Found: true}, readAll(SSE, `data: {"usage":{"prompt_tokens":4}}`, 5))
	// A stream without usage.
	require.Equal(t, Usage{Model: "m"}, readAll(SSE, chunk(`{"model":"m"}`)+chunk("[DONE]"), 0))
	// Responses API: the completed event nests the response.
	resp := "event: response.completed\n" + chunk(`{"type":"response.completed","response":{"model":"o3","usage":{"input_tokens":8,"output_tokens":1}}}`)
	require.Equal(t, Usage{Model: "o3", Input: 8, Output: 1, Found: true}, readAll(SSE, resp, 2))
}

func TestFormatOf(t *testing.T) {
	require.Equal(t, SSE, FormatOf("text/event-stream; charset=utf-8"))
	require.Equal(t, JSON, FormatOf("application/json"))
	require.Equal(t, JSON, FormatOf("application/problem+json"))
	require.Equal(t, None, FormatOf("text/plain"))
	require.Equal(t, None, FormatOf(""))
}

func TestDeepNestingIsBounded(t *testing.T) {
	body := `{"usage":{"prompt_tokens":1},"x":` + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + "}"
	r := NewReader(JSON)
	_, _ = r.Write([]byte(body))
	require.Equal(t, Usage{}, r.Usage(), "nesting past maxDepth is not JSON the reader follows")
	require.LessOrEqual(t, cap(r.scan.stack), 2*maxDepth)
}

func TestAskForUsage(t *testing.T) {
	cases := []struct {
		name, body, want string
		changed          bool
	}{
		{"streamed without options", `{"model":"m","stream":true,"messages":[]}`,
			`{"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[]}`, true},
		{"leading space kept", " \n{ \"stream\" : true }", " \n{\"stream_options\":{\"include_usage\":true}, \"stream\" : true }", true},
		{"caller set options", `{"stream":true,"stream_options":{"include_usage":false}}`, "", false},
		{"caller set empty options", `{"stream":true,"stream_options":{}}`, "", false},
		{"not streamed", `{"stream":false}`, "", false},
		{"stream not a boolean", `{"stream":"true"}`, "", false},
		{"nested stream", `{"x":{"stream":true}}`, "", false},
		{"not JSON", `{"stream":true`, "", false},
		{"an array", `[{"stream":true}]`, "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req := ParseRequest([]byte(c.body))
			got, changed := AskForUsage([]byte(c.body), req)
			require.Equal(t, c.changed, changed)
			if !c.changed {
				require.Equal(t, c.body, string(got))
				return
			}
			require.Equal(t, c.want, string(got))
		})
	}
	require.Equal(t, "gpt-4o", ParseRequest([]byte(`{"model":"gpt-4o"}`)).Model)
}

func TestIsChatCompletions(t *testing.T) {
	require.True(t, IsChatCompletions([]string{"v1", "chat", "completions"}))
	require.True(t, IsChatCompletions([]string{"chat", "completions"}))
	require.False(t, IsChatCompletions([]string{"v1", "completions"}))
	require.False(t, IsChatCompletions([]string{"v1", "responses"}))
}
