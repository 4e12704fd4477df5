package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
)

// usageSink records reports, and what the upstream had sent of the
// response when each arrived.
type usageSink struct {
	mu      sync.Mutex
	reports []UsageReport
	// clientDone is set by the test's client once it read a whole
	// response; late counts the reports that came after that.
	clientDone atomic.Bool
	late       int
}

func (s *usageSink) RecordUsage(_ context.Context, u UsageReport) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reports = append(s.reports, u)
	if s.clientDone.Load() {
		s.late++
	}
}

func (s *usageSink) take() []UsageReport {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reports
	s.reports = nil
	return r
}

// The provider route reads each response's usage as it streams through,
// asks a stream that did not say for its usage, passes every byte through
// unchanged, and reports to the session the handle resolved through.
func TestProviderUsageIsReportedAndBytesPassUnchanged(t *testing.T) {
	const plainBody = `{"id":"c1","model":"m-json","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":4}}}` + "\n"
	const sseBody = "data: {\"model\":\"m-sse\",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n" +
		"data: {\"model\":\"m-sse\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n"
	var mu sync.Mutex
	var bodies []string
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(b))
		mu.Unlock()
		switch {
		case strings.Contains(string(b), `"stream":true`):
			w.Header().Set("Content-Type", "text/event-stream")
			for _, part := range strings.SplitAfter(sseBody, "\n\n") { // one event per flush
				_, _ = io.WriteString(w, part)
				w.(http.Flusher).Flush()
			}
		case strings.Contains(r.URL.Path, "fail"):
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusTooManyRequests)
			_, _ = io.WriteString(w, plainBody)
		default:
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, plainBody)
		}
	}))
	t.Cleanup(up.Close)
	raw, err := handle.New(handle.PerSession)
	require.NoError(t, err)
	res := &grants.Resolved{Secret: []byte("sk-backing"), Member: scope.Member{UserID: "u1", SessionID: "s1", RuntimeSessionID: "rs-1"}}
	res.Grant.Scope = scope.Scope{SandboxID: "sbx-a", Directory: "/w"}
	provider, _ := url.Parse(up.URL + "/v1")
	sink := &usageSink{}
	p, err := New(Config{Resolver: fixedResolver{raw: raw, res: res}, ProviderUpstream: provider,
		AttestationKey: []byte(strings.Repeat("k", 32)), Usage: sink})
	require.NoError(t, err)
	t.Cleanup(p.Close)
	srv := httptest.NewServer(p.Handler())
	t.Cleanup(srv.Close)

	post := func(path, body string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/s/sbx-a/provider/"+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+raw)
		req.Header.Set("Content-Type", "application/json")
		sink.clientDone.Store(false)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		sink.clientDone.Store(true)
		return resp.StatusCode, string(b)
	}
	want := func(model string, in, out, cached uint64) UsageReport {
		return UsageReport{SessionID: "s1", RuntimeSessionID: "rs-1", SandboxID: "sbx-a", Model: model, Input: in, Output: out, Cached: cached}
	}

	code, got := post("chat/completions", `{"model":"m-req","messages":[]}`)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, plainBody, got) //nolint:testifylint // byte for byte: the proxy must not re-encode, an equal JSON is not enough
	require.Equal(t, []UsageReport{want("m-json", 12, 5, 4)}, sink.take())

	// A stream without stream_options is asked for its usage; nothing else
	// of the request changes.
	code, got = post("chat/completions", `{"model":"m-req","stream":true,"messages":[{"role":"user","content":"x"}]}`)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, sseBody, got)
	require.Equal(t, []UsageReport{want("m-sse", 7, 3, 0)}, sink.take())
	// A caller that chose stream_options keeps its choice.
	_, _ = post("chat/completions", `{"stream":true,"stream_options":{"include_usage":false}}`)
	sink.take()
	mu.Lock()
	require.Equal(t, []string{`{"model":"m-req","messages":[]}`,
		`{"stream_options":{"include_usage":true},"model":"m-req","stream":true,"messages":[{"role":"user","content":"x"}]}`,
		`{"stream":true,"stream_options":{"include_usage":false}}`}, bodies)
	mu.Unlock()

	// A refused request (429) reports nothing, whatever its body says.
	code, _ = post("fail/chat/completions", `{}`)
	require.Equal(t, http.StatusTooManyRequests, code)
	require.Empty(t, sink.take())
	// Every report came before its caller could read the response's end:
	// the runtime cannot end a turn on a response not yet counted.
	require.Zero(t, sink.late)
}
