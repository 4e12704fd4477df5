package server

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/credential/internal/proxy"
)

// fakeAuditNotify takes NotifyAudit batches; down refuses them, block
// holds each call until released.
type fakeAuditNotify struct {
	sessionv1.SessionNotifyServiceClient
	mu      sync.Mutex
	batches [][]*sessionv1.ProxyRequestReport
	down    bool
	block   chan struct{}
}

func (f *fakeAuditNotify) NotifyAudit(ctx context.Context, r *sessionv1.NotifyAuditRequest, _ ...grpc.CallOption) (*sessionv1.NotifyAuditResponse, error) {
	if f.block != nil {
		select {
		case <-f.block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.down {
		return nil, errors.New("unavailable")
	}
	f.batches = append(f.batches, r.GetReports())
	return &sessionv1.NotifyAuditResponse{}, nil
}

func (f *fakeAuditNotify) received() (n, batches int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, b := range f.batches {
		n += len(b)
	}
	return n, len(f.batches)
}

func startAuditReporter(t *testing.T, f *fakeAuditNotify) *auditReporter {
	t.Helper()
	r, err := newAuditReporter(f, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

func report(i int) proxy.AuditReport {
	return proxy.AuditReport{SessionID: "s1", SandboxID: "sbx", Route: proxy.RouteProvider, Method: "POST",
		PathTemplate: "chat/completions", Status: 200, BytesIn: uint64(i), Start: time.Unix(1, 0)} //nolint:gosec // small
}

// Reports reach the session service in batches of at most 256, in order.
func TestAuditReportsAreSentInBatches(t *testing.T) {
	f := &fakeAuditNotify{}
	r := startAuditReporter(t, f)
	for i := range 600 {
		r.RecordRequest(report(i))
	}
	require.Eventually(t, func() bool { n, _ := f.received(); return n == 600 }, 10*time.Second, 5*time.Millisecond)
	f.mu.Lock()
	defer f.mu.Unlock()
	next := uint64(0)
	for _, b := range f.batches {
		require.LessOrEqual(t, len(b), auditBatchSize)
		for _, rep := range b {
			require.Equal(t, next, rep.GetRequest().GetBytesIn())
			require.Equal(t, "chat/completions", rep.GetRequest().GetPathTemplate())
			next++
		}
	}
	require.InDelta(t, 600, testutil.ToFloat64(r.sent), 0)
}

// A session service that is down or stuck never holds the proxy: what it
// refuses is dropped as send_failed, and what finds the queue full as
// queue_full; RecordRequest returns at once either way.
func TestAuditReportsAreDroppedNotBlocking(t *testing.T) {
	f := &fakeAuditNotify{down: true}
	r := startAuditReporter(t, f)
	r.RecordRequest(report(1))
	require.Eventually(t, func() bool { return testutil.ToFloat64(r.dropped.WithLabelValues("send_failed")) == 1 }, 10*time.Second, 5*time.Millisecond)

	stuck := &fakeAuditNotify{block: make(chan struct{})}
	r = startAuditReporter(t, stuck)
	for i := range auditQueueSize + auditBatchSize + 100 {
		r.RecordRequest(report(i)) // returns although nothing is taken
	}
	require.Positive(t, testutil.ToFloat64(r.dropped.WithLabelValues("queue_full")))
	close(stuck.block)
}
