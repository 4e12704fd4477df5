package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/services/sandbox/internal/node/provider"
	"agentplane.dev/services/sandbox/internal/node/provider/process"
)

// A full disk at start-up (DESIGN.md 3.4 as amended by issue 33) is a
// reported, retried condition, not an exit: the isolation probe, the
// sockets under <root>/.sockets and the provider's root all write to the
// sandbox root, and a root whose space or inodes something else took would
// otherwise keep the service in a crash loop until it is freed. While it
// waits, a standby server answers on the service's addresses: health
// "liveness" SERVING (the process is fine), "" and the sandbox services
// NOT_SERVING, every other call UNAVAILABLE with the reason, and /metrics
// with sandbox_startup_blocked{reason="disk_full"} 1.

// diskSetup is what start-up writes to the sandbox root.
type diskSetup struct {
	bnd  *boundarySetup
	egr  *egressSetup
	prov *process.Provider
}

func (d *diskSetup) close() {
	d.egr.close()
	d.bnd.close()
}

// setUpDisk makes the sandbox root, probes and binds the boundary, binds
// the egress socket and builds the provider; on failure nothing of it
// stays open.
func setUpDisk(ctx context.Context, cfg Config, wrapperBin string, log *slog.Logger) (*diskSetup, error) {
	if err := mkdirRoot(cfg.SandboxRoot); err != nil {
		return nil, err
	}
	bnd, err := setUpBoundary(ctx, cfg, wrapperBin, log)
	if err != nil {
		return nil, err
	}
	egr, err := listenEgress(bnd, cfg.ReplicaID)
	if err != nil {
		bnd.close()
		return nil, err
	}
	prov, err := newProvider(cfg, bnd, log)
	if err != nil {
		egr.close()
		bnd.close()
		return nil, err
	}
	return &diskSetup{bnd: bnd, egr: egr, prov: prov}, nil
}

// awaitDisk runs setUpDisk until the sandbox root has room. On the first
// full-disk failure it binds the service's listeners (when the caller did
// not) and serves the standby on them; ls then holds the listeners the
// real server takes over.
func awaitDisk(ctx context.Context, cfg Config, wrapperBin string, log *slog.Logger, ls *Listeners) (*diskSetup, error) {
	blocked := func(error) func() {
		g, err := handOff(ls.GRPC, cfg.GRPCAddr)
		if err != nil {
			log.Warn("standby: cannot listen; retrying without it", "err", err)
			return nil
		}
		ls.GRPC = g
		var m *handoff
		if ls.Metrics != nil || cfg.MetricsAddr != "" {
			if m, err = handOff(ls.Metrics, cfg.MetricsAddr); err != nil {
				log.Warn("standby: cannot listen for metrics", "err", err)
			} else {
				ls.Metrics = m
			}
		}
		return standby(log, g, m)
	}
	ds, err := retryWhileFull(ctx, log, func() (*diskSetup, error) { return setUpDisk(ctx, cfg, wrapperBin, log) }, blocked, sleepCtx)
	if err != nil {
		// No server takes the listeners over: close them.
		for _, ln := range []net.Listener{ls.GRPC, ls.Metrics} {
			if h, ok := ln.(*handoff); ok {
				_ = h.Close()
			}
		}
	}
	return ds, err
}

// handOff wraps ln, or a new listener on addr, for the standby and then
// the real server.
func handOff(ln net.Listener, addr string) (*handoff, error) {
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", addr); err != nil {
			return nil, err
		}
	}
	return newHandoff(ln), nil
}

func mkdirRoot(root string) error {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return fmt.Errorf("sandbox root: %w", err)
	}
	return nil
}

// diskFull reports whether err says the disk is full: ENOSPC (bytes or
// inodes) or EDQUOT, as an errno or in a message (a child's stderr).
func diskFull(err error) bool {
	if err == nil {
		return false
	}
	return provider.IsENOSPCEvidence(err, "") || errors.Is(err, syscall.EDQUOT) ||
		strings.Contains(strings.ToLower(err.Error()), "disk quota exceeded")
}

// Start-up retry delays: short first (space often comes back soon), then
// doubling up to startupMaxDelay.
const (
	startupFirstDelay = time.Second
	startupMaxDelay   = 30 * time.Second
)

// startupDelay is the pause after the n-th (from 1) failed attempt.
func startupDelay(n int) time.Duration {
	d := startupFirstDelay
	for i := 1; i < n && d < startupMaxDelay; i++ {
		d *= 2
	}
	return min(d, startupMaxDelay)
}

// retryWhileFull calls try until it succeeds, fails for another reason
// than a full disk, or ctx ends. Before the first wait it calls blocked
// (which returns what to call once the wait is over); each failure is
// logged with the next delay. wait pauses (a timer; injectable for tests).
func retryWhileFull[T any](ctx context.Context, log *slog.Logger, try func() (T, error), blocked func(error) func(),
	wait func(context.Context, time.Duration) error) (T, error) {
	var unblock func()
	asked := false
	defer func() {
		if unblock != nil {
			unblock()
		}
	}()
	for n := 1; ; n++ {
		v, err := try()
		if err == nil {
			if n > 1 {
				log.Warn("sandbox root writable again: starting", "attempts", n)
			}
			return v, nil
		}
		if !diskFull(err) {
			return v, err
		}
		delay := startupDelay(n)
		log.Warn("sandbox root full at start-up: not ready, retrying (free space or inodes on the sandbox root)",
			"err", err, "attempt", n, "retry_in", delay.String())
		if !asked && blocked != nil {
			asked, unblock = true, blocked(err)
		}
		if err := wait(ctx, delay); err != nil {
			return v, err
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// standbyMessage is what the standby server answers every call but health.
const standbyMessage = "the sandbox service is not ready: its sandbox root is full (no space or inodes left); retry"

// standby serves health and metrics on the service's listeners while
// start-up waits for disk; stop hands the listeners on (they stay open).
func standby(log *slog.Logger, grpcLn, metricsLn *handoff) (stop func()) {
	hs := health.NewServer()
	hs.SetServingStatus(grpcserver.LivenessService, healthpb.HealthCheckResponse_SERVING)
	for _, name := range []string{sandboxv1.SandboxService_ServiceDesc.ServiceName, sandboxv1.WrapperControlService_ServiceDesc.ServiceName, ""} {
		hs.SetServingStatus(name, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	gs := grpc.NewServer(grpc.UnknownServiceHandler(func(any, grpc.ServerStream) error {
		return status.Error(codes.Unavailable, standbyMessage)
	}))
	healthpb.RegisterHealthServer(gs, hs)
	var wg sync.WaitGroup
	view := grpcLn.view()
	wg.Go(func() { _ = gs.Serve(view) })
	var hsrv *http.Server
	if metricsLn != nil {
		reg := prometheus.NewRegistry()
		reg.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "agentplane_ready",
			Help: "1 while this process's gRPC health (service \"\") is SERVING, else 0."}))
		blocked := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "sandbox_startup_blocked",
			Help: "1 while the sandbox service's start-up waits, by reason (disk_full: the sandbox root has no space or inodes left)."}, []string{"reason"})
		blocked.WithLabelValues("disk_full").Set(1)
		reg.MustRegister(blocked)
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		hsrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		mview := metricsLn.view()
		wg.Go(func() { _ = hsrv.Serve(mview) })
	}
	log.Warn("standby: health not ready and calls answered UNAVAILABLE until the sandbox root has room", "grpc_addr", grpcLn.Addr().String())
	return func() {
		gs.Stop()
		if hsrv != nil {
			_ = hsrv.Close()
		}
		wg.Wait()
	}
}

// handoff is a bound listener served first by the standby server and then
// by the real one, without closing it in between (another process could
// take the port). A pump accepts; each view hands its connections to one
// server; closing a view ends only that server's Accept. The real server
// gets the handoff itself, whose Close closes the listener.
type handoff struct {
	net.Listener
	accepted chan net.Conn
	failed   chan struct{} // closed when Accept fails for good; err says why
	err      error
	done     chan struct{} // closed by Close
	once     sync.Once
}

func newHandoff(ln net.Listener) *handoff {
	h := &handoff{Listener: ln, accepted: make(chan net.Conn), failed: make(chan struct{}), done: make(chan struct{})}
	go h.pump()
	return h
}

func (h *handoff) pump() {
	for {
		c, err := h.Listener.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			h.err = err
			close(h.failed)
			return
		}
		select {
		case h.accepted <- c:
		case <-h.done:
			_ = c.Close()
			return
		}
	}
}

// Accept is the real server's.
func (h *handoff) Accept() (net.Conn, error) { return h.accept(nil) }

func (h *handoff) accept(closed <-chan struct{}) (net.Conn, error) {
	select {
	case c := <-h.accepted:
		return c, nil
	case <-h.failed:
		return nil, h.err
	case <-h.done:
		return nil, net.ErrClosed
	case <-closed:
		return nil, net.ErrClosed
	}
}

// Close closes the listener (the real server's close).
func (h *handoff) Close() error {
	err := net.ErrClosed
	h.once.Do(func() {
		close(h.done)
		err = h.Listener.Close()
	})
	return err
}

// view is a listener for the standby server: its Close leaves the
// listener open.
func (h *handoff) view() net.Listener { return &handoffView{h: h, closed: make(chan struct{})} }

type handoffView struct {
	h      *handoff
	closed chan struct{}
	once   sync.Once
}

func (v *handoffView) Accept() (net.Conn, error) { return v.h.accept(v.closed) }
func (v *handoffView) Addr() net.Addr            { return v.h.Addr() }
func (v *handoffView) Close() error {
	v.once.Do(func() { close(v.closed) })
	return nil
}
