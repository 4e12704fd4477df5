package ingestpost

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a real HTTP server standing in for the proxy: it records
// every body it read and answers attempt n with answer(n) (0 drops the
// connection without answering, as a proxy killed with -9 does).
type recorder struct {
	mu     sync.Mutex
	bodies []string
	auth   []string
}

func serve(t *testing.T, answer func(n int) int) (*recorder, string) {
	rec := &recorder{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rec.mu.Lock()
		rec.bodies = append(rec.bodies, r.URL.Path+" "+string(body))
		rec.auth = append(rec.auth, r.Header.Get("Authorization"))
		n := len(rec.bodies)
		rec.mu.Unlock()
		code := answer(n)
		if code == 0 {
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				_ = c.Close()
			}
			return
		}
		w.WriteHeader(code)
	}))
	t.Cleanup(srv.Close)
	return rec, srv.URL
}

func (rec *recorder) attempts() []string {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]string(nil), rec.bodies...)
}

func budget(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// The first attempt reaches the proxy, which reads it (it may even have
// applied it) and dies before answering: the batch is sent again, the same
// bytes, and succeeds. Ingest's version compare makes the repeat harmless.
func TestDroppedAttemptIsSentAgain(t *testing.T) {
	rec, url := serve(t, func(n int) int {
		if n == 1 {
			return 0
		}
		return http.StatusOK
	})
	body := []byte(`{"items":[{"item_id":"msg-m1","type":"message","version":1}]}`)
	require.NoError(t, Post(budget(t, 30*time.Second), http.DefaultClient, url+"/", "h-secret", "rs_1", body))
	want := "/ingest/v1/sessions/rs_1/items " + string(body)
	require.Equal(t, []string{want, want}, rec.attempts())
	require.Equal(t, []string{"Bearer h-secret", "Bearer h-secret"}, rec.auth)
}

func TestGatewayAnswersAreRetriedOthersAreFinal(t *testing.T) {
	codes := []int{http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout, http.StatusOK}
	rec, url := serve(t, func(n int) int { return codes[n-1] })
	require.NoError(t, Post(budget(t, 30*time.Second), http.DefaultClient, url, "h", "rs", []byte(`{}`)))
	require.Len(t, rec.attempts(), 4)

	for _, code := range []int{http.StatusBadRequest, http.StatusForbidden, http.StatusNotFound, http.StatusTooManyRequests} {
		rec, url := serve(t, func(int) int { return code })
		err := Post(budget(t, 30*time.Second), http.DefaultClient, url, "h-secret", "rs", []byte(`{}`))
		require.ErrorContains(t, err, "proxy answered")
		require.NotContains(t, err.Error(), "h-secret")
		require.Len(t, rec.attempts(), 1, "%d is final", code)
	}
}

// A proxy that never comes back: the writer gives up when its budget ends
// and says why, without the handle.
func TestGivesUpWhenTheBudgetEnds(t *testing.T) {
	rec, url := serve(t, func(int) int { return http.StatusServiceUnavailable })
	err := Post(budget(t, time.Second), http.DefaultClient, url, "h-secret", "rs", []byte(`{}`))
	require.ErrorContains(t, err, "proxy answered 503 (gave up after")
	require.NotContains(t, err.Error(), "h-secret")
	require.Greater(t, len(rec.attempts()), 1)

	// Nothing listening at all.
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	err = Post(budget(t, time.Second), http.DefaultClient, srv.URL, "h-secret", "rs", []byte(`{}`))
	require.ErrorContains(t, err, "proxy unreachable (gave up after")
}
