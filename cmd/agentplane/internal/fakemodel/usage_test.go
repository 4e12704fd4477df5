package fakemodel

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Replies report usage as OpenAI's API does: every JSON reply, and a
// stream only when its request asked (stream_options.include_usage); the
// record holds what each reported.
func TestRepliesReportUsage(t *testing.T) {
	s := New()
	post := func(req map[string]any) string {
		body, err := json.Marshal(req)
		require.NoError(t, err)
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body)))
		require.Equal(t, http.StatusOK, rec.Code)
		return rec.Body.String()
	}
	msgs := []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": "hi"}}

	out := post(map[string]any{"model": "fake-model", "messages": msgs})
	require.Contains(t, out, `"usage":{"completion_tokens":15,"prompt_tokens":120,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":135}`)
	out = post(map[string]any{"model": "fake-model", "messages": msgs, "stream": true})
	require.NotContains(t, out, `"usage"`, "a stream not asked for usage")
	require.True(t, strings.HasSuffix(out, "data: [DONE]\n\n"))
	out = post(map[string]any{"model": "fake-model", "messages": msgs, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	require.Contains(t, out, `"choices":[],"created"`)
	require.Contains(t, out, `"prompt_tokens":120`)

	reqs := s.Requests()
	require.Len(t, reqs, 3)
	want := Usage{PromptTokens: 120, CompletionTokens: 15, CachedTokens: 4} // the greeting is 3 chunks
	require.Equal(t, want, reqs[0].Usage)
	require.Equal(t, Usage{}, reqs[1].Usage)
	require.False(t, reqs[1].IncludeUsage)
	require.True(t, reqs[2].IncludeUsage)
	require.Equal(t, uint64(120), reqs[2].Usage.PromptTokens)
	require.Contains(t, out, fmt.Sprintf(`"completion_tokens":%d,`, reqs[2].Usage.CompletionTokens))
}
