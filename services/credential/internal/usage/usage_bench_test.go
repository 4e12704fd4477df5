package usage

import (
	"strings"
	"testing"
)

// The reader's cost per byte of a provider response (it sees every byte the
// proxy copies):
//
//	go test ./internal/usage -run '^$' -bench . -benchtime 2000x
func BenchmarkReader(b *testing.B) {
	var sse strings.Builder
	for range 200 {
		sse.WriteString(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"content":"some words of a reply \"quoted\" and more"},"finish_reason":null}],"usage":null}` + "\n\n")
	}
	sse.WriteString(`data: {"model":"gpt-4o","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5}}` + "\n\ndata: [DONE]\n\n")
	body := `{"id":"c","model":"gpt-4o","choices":[{"message":{"content":"` + strings.Repeat("a reply with \\\"escapes\\\" ", 400) + `"}}],"usage":{"prompt_tokens":10,"completion_tokens":5}}`
	for _, c := range []struct {
		name   string
		format Format
		body   []byte
	}{{"sse", SSE, []byte(sse.String())}, {"json", JSON, []byte(body)}} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(c.body)))
			b.ReportAllocs()
			for b.Loop() {
				r := NewReader(c.format)
				for p := c.body; len(p) > 0; p = p[min(len(p), 4096):] {
					_, _ = r.Write(p[:min(len(p), 4096)])
				}
				if !r.Usage().Found {
					b.Fatal("no usage")
				}
			}
		})
	}
}
