package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"agentplane.dev/pkg/grpcclient"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/pkg/telemetry"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/control/reconciler"
	"agentplane.dev/services/sandbox/internal/control/tenancy"
	"agentplane.dev/services/sandbox/internal/edge/credclient"
	"agentplane.dev/services/sandbox/internal/edge/grpcapi"
	"agentplane.dev/services/sandbox/internal/edge/notify"
	"agentplane.dev/services/sandbox/internal/node/capacity"
	"agentplane.dev/services/sandbox/internal/node/provider"
	"agentplane.dev/services/sandbox/internal/node/provider/process"
	"agentplane.dev/services/sandbox/internal/node/warmpool"
)

// Listeners lets a caller (tests, agentplane dev) pass bound listeners;
// nil fields listen on the configured addresses.
type Listeners struct {
	GRPC, Metrics net.Listener
}

// Run connects Redis, builds the gRPC server, drives owned sandboxes and
// serves until ctx ends; nil after a clean drain.
func Run(ctx context.Context, cfg Config) error {
	return RunWith(ctx, cfg, Listeners{})
}

// RunWith is Run on given listeners (nil: listen on the configured addresses).
func RunWith(ctx context.Context, cfg Config, ls Listeners) error {
	log := cfg.Logger().With("service", "sandbox", "replica", cfg.ReplicaID)
	if cfg.advertiseAddr(ls.GRPC) == "" {
		log.Warn("no address to advertise in owner leases (set AGENTPLANE_SANDBOX_ADVERTISE_ADDR): callers find owners through their balancer only")
	}
	rdb, err := cfg.Redis()
	if err != nil {
		return err
	}
	defer func() { _ = rdb.Close() }() // for every earlier return; Serve closes it in its shutdown order
	wrapperCmd, err := cfg.wrapperCommand()
	if err != nil {
		return fmt.Errorf("wrapper command: %w", err)
	}
	// A full sandbox root is waited out, reported (standby), not an exit.
	ds, err := awaitDisk(ctx, cfg, wrapperCmd[0], log, &ls)
	if err != nil {
		if errors.Is(err, context.Canceled) && ctx.Err() != nil {
			return nil // stopped while waiting for room
		}
		return err
	}
	defer ds.close()
	bnd, egr, prov := ds.bnd, ds.egr, ds.prov
	wrapperCmd = append(append(wrapperCmd, bnd.wrapperFlags...), egr.wrapperFlags...)
	recMetrics, admissions := reconciler.NewMetrics(), newAdmissions()
	rec, drvRef := newReconciler(rdb, prov, log, recMetrics)

	peers := grpcclient.NewConns(cfg.InternalToken)
	defer peers.Close()
	notifyClient, credClient, err := dialPeers(cfg, peers)
	if err != nil {
		return err
	}
	notifier := notify.New(notifyClient, log.With("component", "notify"), 0)
	control, proxyURL := cfg.wrapperReach(bnd, ls.GRPC)
	drv := driver.New(driver.Config{
		Redis: rdb, Provider: prov, Wrappers: rec, Notifier: notifier, Credentials: credclient.New(credClient),
		ReplicaID: cfg.ReplicaID, AdvertiseAddr: cfg.advertiseAddr(ls.GRPC), OwnerTTL: cfg.OwnerTTL, EmptyGrace: cfg.EmptyGrace, Timers: cfg.Timers, WrapperCommand: wrapperCmd,
		ControlAddrs: control, ProxyURL: proxyURL, Logger: log.With("component", "driver"), Agents: cfg.Agents(),
		Admission: coldAdmission{prov: prov, admit: capacity.New(prov, capacity.Config{Reserved: prov.Reserved,
			ThresholdBytes: uint64(cfg.CapacityThreshold), StaleAge: cfg.StaleAge, Logger: log.With("component", "capacity")}), results: admissions},
	})
	drvRef.Store(drv)

	// Tracing from OTEL_* (exporting is opt-in); set up last so no early failure leaks it.
	tel, err := telemetry.Setup(ctx, "agentplane-sandbox")
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
	}
	defer func() { _ = tel.Shutdown(context.WithoutCancel(ctx)) }() // a no-op after Serve flushed it
	srv, err := grpcserver.New(serverOptions(cfg, log, rdb, tel, ls, drv))
	if err != nil {
		return err
	}
	if err := registerServices(srv, cfg, rdb, drv, notifier, egr, recMetrics, admissions, log); err != nil {
		return err
	}
	pool, err := newPool(cfg, drv, prov, log)
	if err != nil {
		return err
	}
	if err := pool.Register(srv.Registry()); err != nil {
		return err
	}

	srv.Go(func(ctx context.Context) { runLoops(ctx, cfg, log, notifier, rec, drv, prov, pool) })
	return serve(ctx, srv, bnd.controlLn)
}

// newProvider builds the process provider that runs the sandboxes'
// wrappers inside the boundary.
func newProvider(cfg Config, bnd *boundarySetup, log *slog.Logger) (*process.Provider, error) {
	return process.New(process.Config{Root: cfg.SandboxRoot, Logger: log.With("component", "provider"),
		Deployment: cfg.Deployment, Isolation: bnd.iso, BaseEnv: wrapperBaseEnv(os.LookupEnv),
		Cgroups: bnd.cgroups, CgroupLimits: cfg.cgroupLimits(), DiskQuota: uint64(cfg.DiskQuota),
		MemoryLimit: uint64(cfg.MemoryLimit), Nice: cfg.Nice})
}

// newPool builds this replica's warm pool (SANDBOX_POOL; empty: a pool of
// none, which only sweeps what an earlier run left).
func newPool(cfg Config, drv *driver.Driver, prov *process.Provider, log *slog.Logger) (*warmpool.Pool, error) {
	sizes, err := ParsePool(cfg.Pool)
	if err != nil {
		return nil, err
	}
	return warmpool.New(warmpool.Config{Sizes: sizes, Directory: cfg.PoolDirectory, Shape: drv.PoolShape,
		Room: prov, ReserveBytes: 2 * uint64(cfg.CapacityThreshold), Logger: log.With("component", "pool")}, prov, nil), nil
}

// serve runs srv until ctx ends (a cancelled context is a clean stop).
// With a control socket, the same server serves it too (after every
// service is registered; its GracefulStop ends both), but every sandbox
// holds that socket: there it serves the wrapper's stream and health only,
// with or without an internal token (DESIGN.md 3.3).
func serve(ctx context.Context, srv *grpcserver.Server, controlLn net.Listener) error {
	if controlLn != nil {
		go func() { _ = srv.ServeRestricted(controlLn, grpcapi.ControlSocketServes) }()
	}
	err := srv.Serve(ctx)
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// newReconciler builds the wrapper-lease reconciler; it wakes the driver
// stored into the returned pointer once that is built.
func newReconciler(rdb redis.UniversalClient, prov *process.Provider, log *slog.Logger, m *reconciler.Metrics) (*reconciler.Reconciler, *atomic.Pointer[driver.Driver]) {
	drvRef := &atomic.Pointer[driver.Driver]{}
	rec := reconciler.New(reconciler.Config{
		Redis: rdb, Provider: prov, Logger: log.With("component", "reconciler"), Metrics: m,
		Stopped: func(sandboxID, runtimeKey string) {
			if d := drvRef.Load(); d != nil {
				// Off the reconciler's key lock: the driver takes its own locks.
				go d.WrapperStopped(sandboxID, runtimeKey)
			}
		},
	})
	return rec, drvRef
}

// serverOptions are the sandbox service's gRPC server settings.
func serverOptions(cfg Config, log *slog.Logger, rdb redis.UniversalClient, tel *telemetry.Provider, ls Listeners, drv *driver.Driver) grpcserver.Options {
	return grpcserver.Options{
		Name: "sandbox", Logger: log, Redis: rdb, Telemetry: tel, Addr: cfg.GRPCAddr, Listener: ls.GRPC, MetricsAddr: cfg.MetricsAddr, MetricsListener: ls.Metrics,
		InternalToken: cfg.InternalToken, DrainDelay: cfg.DrainDelay, ShutdownTimeout: cfg.ShutdownTimeout,
		AuthExempt: func(m string) bool { return m == grpcapi.ConnectMethod },
		// Wrappers heartbeat every few seconds; allow client pings that often.
		KeepaliveMinTime: time.Second,
		// Wrapper streams never end by themselves: end them when the
		// graceful stop begins so it waits only for real in-flight calls.
		OnShutdownStep: func(st grpcserver.ShutdownStep) {
			if st == grpcserver.StepGracefulStop {
				drv.CloseWrapperStreams()
			}
		},
	}
}

// dialPeers connects the session service's notify API and the credential
// service, each when configured (nil clients otherwise).
func dialPeers(cfg Config, peers *grpcclient.Conns) (sessionv1.SessionNotifyServiceClient, credentialv1.CredentialServiceClient, error) {
	var notifyClient sessionv1.SessionNotifyServiceClient
	if cfg.SessionAddr != "" {
		c, err := peers.Dial(cfg.SessionAddr)
		if err != nil {
			return nil, nil, err
		}
		notifyClient = sessionv1.NewSessionNotifyServiceClient(c)
	}
	var credClient credentialv1.CredentialServiceClient
	if cfg.CredentialAddr != "" {
		c, err := peers.Dial(cfg.CredentialAddr)
		if err != nil {
			return nil, nil, err
		}
		credClient = credentialv1.NewCredentialServiceClient(c)
	}
	return notifyClient, credClient, nil
}

// wrapperReach is where wrappers dial this replica and where their runtimes
// find the proxy.
func (c *Config) wrapperReach(bnd *boundarySetup, grpcLn net.Listener) (control []string, proxyURL string) {
	control = splitList(c.ControlAddrs)
	if len(control) == 0 {
		control = []string{c.localControlAddr(grpcLn)}
	}
	proxyURL = c.ProxyURL
	if bnd.iso != nil {
		// Behind the boundary a wrapper has no network: it dials this
		// replica's socket first, then the node's other replicas', and the
		// runtime finds the proxy on its own loopback.
		control = []string{bnd.controlAddr}
		if proxyURL != "" {
			u, _ := url.Parse(proxyURL) // validated
			proxyURL = u.Scheme + "://" + sandboxProxyAddr
		}
	}
	return control, proxyURL
}

// runLoops runs the notifier, reconciler and driver loops until ctx ends.
// The loops stop after the last call and before Redis closes: the driver's
// last act is releasing its sandboxes and writing their state, so another
// replica takes them over at once. Then the notifier drains, bounded, what
// is still queued (turn outcomes above all).
func runLoops(ctx context.Context, cfg Config, log *slog.Logger, notifier *notify.Notifier, rec *reconciler.Reconciler, drv *driver.Driver, prov provider.Limiter, pool *warmpool.Pool) {
	var loops sync.WaitGroup
	loops.Go(func() { notifier.Run(ctx) })
	loops.Go(func() { pool.Run(ctx) })
	loops.Go(func() { _ = rec.Run(ctx) })
	loops.Go(func() { drv.Run(ctx) })
	loops.Go(func() { enforceLimits(ctx, prov, drv, log) })
	loops.Wait()
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.NotifyDrain)
	defer cancel()
	if unsent := notifier.Drain(dctx); unsent > 0 {
		log.Warn("notifications left unsent at shutdown", "count", unsent)
	}
}

// registerServices puts the metrics, the egress proxy and the two gRPC
// services on srv.
func registerServices(srv *grpcserver.Server, cfg Config, rdb redis.UniversalClient, drv *driver.Driver, notifier *notify.Notifier, egr *egressSetup,
	recMetrics *reconciler.Metrics, admissions *prometheus.CounterVec, log *slog.Logger) error {
	registerMetrics(srv.Registry(), drv)
	registerNotifyMetrics(srv.Registry(), notifier)
	if err := registerObservability(srv.Registry(), recMetrics, admissions); err != nil {
		return err
	}
	if err := egr.serve(cfg.Egress, drv, notifier, srv.Registry(), log.With("component", "egress")); err != nil {
		return err
	}
	sandboxv1.RegisterSandboxServiceServer(srv, &grpcapi.Sandbox{Driver: drv, Tenants: tenancy.Binder{Redis: rdb}, Log: log})
	sandboxv1.RegisterWrapperControlServiceServer(srv, &grpcapi.Wrapper{Driver: drv, Log: log})
	return nil
}

func registerMetrics(reg *prometheus.Registry, d *driver.Driver) {
	counter := func(name, help string, f func() float64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, f))
	}
	counter("sandbox_stale_token_rejections_total", "Sandbox state writes rejected by the owner fence.",
		func() float64 { return float64(d.Metrics.StaleTokenRejections.Load()) })
	counter("sandbox_owner_lease_losses_total", "Owner leases of sandboxes this replica lost.",
		func() float64 { return float64(d.Metrics.LeaseLosses.Load()) })
	counter("sandbox_takeovers_total", "Sandboxes this replica took over from a dead owner.",
		func() float64 { return float64(d.Metrics.Takeovers.Load()) })
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sandbox_owned_sandboxes",
		Help: "Sandboxes this replica drives now (owner leases held)."},
		func() float64 { return float64(d.OwnedCount()) }))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sandbox_owner_leases_unconfirmed",
		Help: "Owned sandboxes whose owner lease is past its deadline without a confirmed renewal (Redis unreachable or failing over); deliveries wait."},
		func() float64 { return float64(d.UnconfirmedCount()) }))
	for _, runtime := range []string{"running", "stopped"} {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "agentplane_sandbox_open_routes",
			Help:        "Open routes (sessions) of the sandboxes this replica drives, by runtime: running (its wrapper up or coming up) or stopped (suspended, stopped idle, not launched). Sum over replicas.",
			ConstLabels: prometheus.Labels{"runtime": runtime}},
			func() float64 {
				running, stopped := d.RouteCounts()
				if runtime == "running" {
					return float64(running)
				}
				return float64(stopped)
			}))
	}
	counter("sandbox_capacity_rejections_total", "Cold workspaces refused by capacity admission (CAPACITY_REJECTED).",
		func() float64 { return float64(d.Metrics.CapacityRejections.Load()) })
	counter("sandbox_recovery_kept_workspaces_total", "Workspaces an ENOSPC recovery kept because they hold files (maybe changes not pushed or exported).",
		func() float64 { return float64(d.Metrics.RecoveryKeptWorkspaces.Load()) })
}

func registerNotifyMetrics(reg *prometheus.Registry, n *notify.Notifier) {
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sandbox_notification_queue_depth",
		Help: "Notifications to the session service queued (bounded: see docs/sandbox.md)."},
		func() float64 { return float64(n.Depth()) }))
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "sandbox_notifications_dropped_total",
		Help: "Notifications to the session service dropped: by the queue's bound, not retryable, or failing past the give-up time."},
		func() float64 { return float64(n.Dropped()) }))
}

// coldAdmission runs capacity admission for the process provider: a
// workspace directory that already exists is warm (no check).
type coldAdmission struct {
	prov    *process.Provider
	admit   *capacity.Admission
	results *prometheus.CounterVec // by admissionResult
}

func (a coldAdmission) Admit(ctx context.Context, sandboxID, directory string, inUse []string) error {
	_, err := os.Stat(a.prov.WorkspaceDir(sandboxID, directory))
	warm := err == nil
	if err := a.prov.CheckQuota(sandboxID); err != nil {
		a.results.WithLabelValues(admissionResult(false, 0, err)).Inc()
		return err
	}
	kept := make([]string, 0, len(inUse))
	for _, name := range inUse {
		kept = append(kept, process.WorkspaceName(name))
	}
	rep, err := a.admit.Admit(ctx, sandboxID, process.WorkspaceName(directory), warm, kept...)
	a.results.WithLabelValues(admissionResult(warm, rep.Cleaned, err)).Inc()
	return err
}
