package scripted

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const handle = "aph_test-handle-value"

// A real HTTP proxy stand-in: the provider route answers, ingest is 404.
func newProxy(t *testing.T) (*httptest.Server, func() []string) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		mu.Unlock()
		if r.URL.Path != "/provider/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		_, _ = io.WriteString(w, `{"choices":[{"message":{"role":"assistant","content":"upstream says hi"}}]}`)
	}))
	t.Cleanup(srv.Close)
	return srv, func() []string { mu.Lock(); defer mu.Unlock(); return append([]string(nil), seen...) }
}

type session struct {
	in   *io.PipeWriter
	out  chan runtimejsonl.Frame
	raw  *strings.Builder
	done chan error
}

func start(t *testing.T) *session {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	r := &Runtime{out: runtimejsonl.NewWriter(outW), ingest: true, http: &http.Client{Timeout: 5 * time.Second, CheckRedirect: noRedirect}, routes: map[string]*route{}}
	s := &session{in: inW, out: make(chan runtimejsonl.Frame, 1000), raw: &strings.Builder{}, done: make(chan error, 1)}
	go func() { s.done <- r.Run(inR); _ = outW.Close() }()
	var rawMu sync.Mutex
	go func() {
		sc := bufio.NewScanner(outR)
		for sc.Scan() {
			rawMu.Lock()
			s.raw.WriteString(sc.Text() + "\n")
			rawMu.Unlock()
			f, err := runtimejsonl.Parse(sc.Bytes())
			if err == nil {
				s.out <- f
			}
		}
		close(s.out)
	}()
	return s
}

func (s *session) send(t *testing.T, f runtimejsonl.Frame) {
	b, err := json.Marshal(f)
	require.NoError(t, err)
	_, err = s.in.Write(append(b, '\n'))
	require.NoError(t, err)
}

// next returns frames until an outcome for session arrives.
func (s *session) untilOutcome(t *testing.T, sessionID string) []runtimejsonl.Frame {
	var got []runtimejsonl.Frame
	timeout := time.After(20 * time.Second)
	for {
		select {
		case f, ok := <-s.out:
			require.True(t, ok, "runtime output ended")
			got = append(got, f)
			if f.Type == runtimejsonl.TypeOutcome && f.SessionID == sessionID {
				return got
			}
		case <-timeout:
			t.Fatalf("no outcome for %s; got %+v", sessionID, got)
		}
	}
}

func TestTurnCallsProviderAndNeverEchoesHandle(t *testing.T) {
	proxy, seen := newProxy(t)
	s := start(t)
	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: "s1", Directory: t.TempDir(), Handle: handle, ProxyURL: proxy.URL})
	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeMessage, SessionID: "s1", MessageID: "m1", Content: "hello"})
	frames := s.untilOutcome(t, "s1")

	var kinds []string
	var providerResult map[string]any
	outcomes := 0
	for _, f := range frames {
		switch f.Type {
		case runtimejsonl.TypeEvent:
			kinds = append(kinds, f.Event.Kind)
			if f.Event.ToolName == "provider" && f.Event.Kind == runtimejsonl.KindToolResult {
				providerResult = f.Event.Data
			}
		case runtimejsonl.TypeOutcome:
			outcomes++
			require.Equal(t, runtimejsonl.ResultSucceeded, f.Outcome.Result)
			require.Equal(t, "m1", f.Outcome.LastMessageID)
		}
	}
	require.Equal(t, 1, outcomes)
	require.Subset(t, kinds, []string{"progress", "tool_call", "tool_result", "message_delta", "message"})
	require.NotNil(t, providerResult)
	require.EqualValues(t, 200, providerResult["status"])
	require.Equal(t, "upstream says hi", providerResult["reply"])
	require.Len(t, providerResult["sha256"], 64)
	require.Contains(t, seen(), "POST /provider/v1/chat/completions Bearer "+handle)
	// The ingest post went out and its 404 was tolerated.
	require.Eventually(t, func() bool {
		for _, l := range seen() {
			if strings.HasPrefix(l, "POST /ingest/v1/sessions/") {
				return true
			}
		}
		return false
	}, 5*time.Second, 10*time.Millisecond)

	// Fail and abort paths, each with exactly one outcome.
	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeMessage, SessionID: "s1", MessageID: "m2", Content: "fail: please"})
	out := s.untilOutcome(t, "s1")
	last := out[len(out)-1]
	require.Equal(t, runtimejsonl.ResultFailed, last.Outcome.Result)
	require.Equal(t, "tool_error", last.Outcome.FailureReason)

	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeMessage, SessionID: "s1", MessageID: "m3", Content: "slow: think"})
	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeAbort, SessionID: "s1", MessageID: "m3"})
	out = s.untilOutcome(t, "s1")
	require.Equal(t, runtimejsonl.ResultCancelled, out[len(out)-1].Outcome.Result)

	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeShutdown})
	require.NoError(t, <-s.done)
	_ = s.in.Close()
	for range s.out {
	}
	require.NotContains(t, s.raw.String(), handle, "the handle never leaves stdin")
}

// The proxy replica a history post reached died before answering (its
// connection dropped): the runtime sends the same batch again and the
// turn's outcome comes only after the proxy took it, so a completed message
// has its history.
func TestHistoryPostIsSentAgainAfterADroppedConnection(t *testing.T) {
	var mu sync.Mutex
	var posts []string
	stored := false
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, "/ingest/") {
			http.NotFound(w, r)
			return
		}
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		posts = append(posts, string(body))
		first := len(posts) == 1
		stored = !first
		mu.Unlock()
		if first {
			c, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				_ = c.Close()
			}
			return
		}
		_, _ = io.WriteString(w, `{"applied":5,"ignored":0}`)
	}))
	t.Cleanup(srv.Close)

	s := start(t)
	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeOpenRoute, SessionID: "s1", RuntimeSessionID: "rs_1", Directory: t.TempDir(), Handle: handle, ProxyURL: srv.URL})
	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeMessage, SessionID: "s1", MessageID: "m1", Content: "hello"})
	frames := s.untilOutcome(t, "s1")
	require.Equal(t, runtimejsonl.ResultSucceeded, frames[len(frames)-1].Outcome.Result)

	mu.Lock()
	require.True(t, stored, "the outcome came after the history was stored")
	require.Len(t, posts, 2)
	require.Equal(t, posts[0], posts[1], "the retry is the same batch (idempotent by item id and version)")
	require.Contains(t, posts[1], `"item_id":"msg-m1"`)
	require.Contains(t, posts[1], `"item_id":"reply-m1"`)
	mu.Unlock()

	s.send(t, runtimejsonl.Frame{Type: runtimejsonl.TypeShutdown})
	require.NoError(t, <-s.done)
	_ = s.in.Close()
	for range s.out {
	}
}
