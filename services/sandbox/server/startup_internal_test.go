package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/grpcserver"
)

func TestStartupDelayDoublesToItsCap(t *testing.T) {
	var got []time.Duration
	for n := 1; n <= 8; n++ {
		got = append(got, startupDelay(n))
	}
	s := time.Second
	require.Equal(t, []time.Duration{s, 2 * s, 4 * s, 8 * s, 16 * s, 30 * s, 30 * s, 30 * s}, got)
}

func TestDiskFull(t *testing.T) {
	require.True(t, diskFull(fmt.Errorf("probe: %w", &net.OpError{Err: syscall.ENOSPC})))
	require.True(t, diskFull(fmt.Errorf("sandbox root: %w", syscall.EDQUOT)))
	require.True(t, diskFull(errors.New("bwrap: Can't mkdir /x: No space left on device")))
	require.False(t, diskFull(errors.New("bubblewrap (bwrap) not found on PATH")))
	require.False(t, diskFull(nil))
}

// Issue 33 item 6: a full disk at start-up is reported and retried with
// backoff, the standby up from the first failure to the success; any
// other failure still ends start-up at once.
func TestRetryWhileFullReportsAndRetries(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	var waits []time.Duration
	wait := func(_ context.Context, d time.Duration) error { waits = append(waits, d); return nil }
	full := fmt.Errorf("probe: %w", syscall.ENOSPC)
	var events []string
	blocked := func(err error) func() {
		require.ErrorIs(t, err, syscall.ENOSPC)
		events = append(events, "standby")
		return func() { events = append(events, "standby stopped") }
	}
	tries := 0
	v, err := retryWhileFull(context.Background(), log, func() (int, error) {
		tries++
		events = append(events, fmt.Sprint("try ", tries))
		if tries <= 3 {
			return 0, full
		}
		return 42, nil
	}, blocked, wait)
	require.NoError(t, err)
	require.Equal(t, 42, v)
	require.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second}, waits)
	require.Equal(t, []string{"try 1", "standby", "try 2", "try 3", "try 4", "standby stopped"}, events)

	other := errors.New("bubblewrap (bwrap) not found on PATH")
	_, err = retryWhileFull(context.Background(), log, func() (int, error) { return 0, other }, func(error) func() {
		t.Fatal("no standby for a configuration error")
		return nil
	}, wait)
	require.ErrorIs(t, err, other)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	stopped := false
	_, err = retryWhileFull(ctx, log, func() (int, error) { return 0, full }, func(error) func() { return func() { stopped = true } }, sleepCtx)
	require.ErrorIs(t, err, context.Canceled)
	require.True(t, stopped, "the standby stops when start-up is given up")
}

// The standby answers health (liveness serving, readiness not) and every
// other call UNAVAILABLE; once stopped, the same bound listener serves the
// real server.
func TestStandbyThenRealServerOnOneListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	mln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	h, m := newHandoff(ln), newHandoff(mln)
	stop := standby(slog.New(slog.DiscardHandler), h, m)

	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	check := func(svc string) healthpb.HealthCheckResponse_ServingStatus {
		resp, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		require.NoError(t, err)
		return resp.GetStatus()
	}
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, check(grpcserver.LivenessService))
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, check(""))
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, check(sandboxv1.SandboxService_ServiceDesc.ServiceName))
	_, err = sandboxv1.NewSandboxServiceClient(conn).Status(context.Background(), &sandboxv1.StatusRequest{})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "sandbox root is full")

	body := getBody(t, "http://"+mln.Addr().String()+"/metrics")
	require.Contains(t, body, `sandbox_startup_blocked{reason="disk_full"} 1`)
	require.Contains(t, body, "agentplane_ready 0")

	stop()
	srv := grpc.NewServer()
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(h) }()
	require.Eventually(t, func() bool {
		resp, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: ""})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}, 10*time.Second, 10*time.Millisecond, "the srv server serves on the listener the standby had")
	srv.Stop()
	require.NoError(t, <-done)
	_, err = net.Dial("tcp", ln.Addr().String())
	require.Error(t, err, "the srv server's stop closes the listener")
	require.NoError(t, m.Close())
}

func getBody(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}
