package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/telemetry"

	"agentplane.dev/services/session/internal/peers"

	"agentplane.dev/pkg/grpcclient"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/pkg/logging"
	"agentplane.dev/services/session/internal/grpcapi"
	"agentplane.dev/services/session/internal/service"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Listeners lets a caller (tests, agentplane dev) pass bound listeners;
// nil fields listen on the configured addresses.
type Listeners struct {
	GRPC, Metrics net.Listener
}

// Run serves the session service until ctx ends; nil after a clean drain.
func Run(ctx context.Context, cfg Config) error { return RunWith(ctx, cfg, Listeners{}) }

// RunWith is Run on given listeners.
func RunWith(ctx context.Context, cfg Config, ls Listeners) error { return run(ctx, cfg, ls, hooks{}) }

// hooks let tests in this package inject a clock, reach the service's
// sweeper and read its log.
type hooks struct {
	now       func() time.Time
	started   func(*service.Service)
	logOutput io.Writer
}

func run(ctx context.Context, cfg Config, ls Listeners, h hooks) error {
	log := cfg.Logger()
	if h.logOutput != nil {
		log = logging.New(h.logOutput, logging.JSON, cfg.LogLevel)
	}
	log = log.With("service", "session")
	rdb, err := cfg.Redis()
	if err != nil {
		return err
	}
	// Serve closes Redis in its shutdown order; this covers every earlier
	// return and is a no-op after Serve.
	defer func() { _ = rdb.Close() }()

	conns := grpcclient.NewConns(cfg.InternalToken)
	defer conns.Close()
	backstops := session.Backstops{QueuedFor: cfg.QueuedTimeout, AcceptedFor: cfg.AcceptedTimeout, Redrive: cfg.QueuedRedrive}
	deps, err := newDeps(cfg, rdb, conns, backstops, log)
	if err != nil {
		return err
	}
	svc := service.New(deps, service.Config{
		Backstops:         backstops,
		Retention:         cfg.Retention,
		SweepInterval:     cfg.SweepInterval,
		ReconcileInterval: cfg.ReconcileInterval,
		DeletionBackoff:   session.Backoff{Base: cfg.DeleteBackoffBase, Max: cfg.DeleteBackoffMax},
		DeletionLeaseTTL:  cfg.DeleteLeaseTTL,
		WipeLocatorTTL:    cfg.WipeLocatorTTL,
		PeerTimeout:       cfg.PeerTimeout,
		WatchBlock:        cfg.WatchBlock,
		Owner:             cfg.ReplicaID,
		EgressMaxRules:    cfg.EgressMaxRules,
		Suspend:           cfg.SuspendPolicy(),
		Prices:            cfg.Prices(),
		Now:               h.now,
	})
	// Tracing from OTEL_* (exporting is opt-in); set up last so no early failure leaks it.
	tel, err := telemetry.Setup(ctx, "agentplane-session")
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
	}
	defer func() { _ = tel.Shutdown(context.WithoutCancel(ctx)) }() // a no-op after Serve flushed it
	srv, err := grpcserver.New(grpcserver.Options{
		Name: "session", Logger: log, Redis: rdb, Telemetry: tel,
		Addr: cfg.GRPCAddr, Listener: ls.GRPC, MetricsAddr: cfg.MetricsAddr, MetricsListener: ls.Metrics,
		InternalToken: cfg.InternalToken, DrainDelay: cfg.DrainDelay, ShutdownTimeout: cfg.ShutdownTimeout,
		Unlisted: []string{sessionv1.SessionNotifyService_ServiceDesc.ServiceName},
	})
	if err != nil {
		return err
	}
	if err := deps.Metrics.Register(srv.Registry(), deps.Store.StateCounts); err != nil {
		return err
	}
	sessionv1.RegisterSessionServiceServer(srv, grpcapi.NewSessionAPI(svc, log))
	sessionv1.RegisterSessionNotifyServiceServer(srv, grpcapi.NewNotifyAPI(svc, log))
	svc.Start()
	if h.started != nil {
		h.started(svc)
	}
	// The service's loops and watchers stop as soon as shutdown begins, while
	// Redis is still open; Serve then drains the remaining unary calls.
	sctx, cancel := context.WithCancel(ctx)
	closed := make(chan struct{})
	go func() {
		select {
		case <-sctx.Done():
		case <-cfg.StopLoops: // nil: never
		}
		svc.Close()
		close(closed)
	}()
	err = srv.Serve(sctx)
	cancel()
	<-closed
	return err
}

// newDeps is the service's store and its peers: the sandbox service through
// the owner router, the credential and ingest services when configured.
func newDeps(cfg Config, rdb redis.UniversalClient, conns *grpcclient.Conns, backstops session.Backstops, log *slog.Logger) (service.Deps, error) {
	// Sandbox replicas are not interchangeable: each sandbox has one owner.
	// The router sends each call to the owner the sandbox service names.
	sbxConn, err := conns.Dial(cfg.SandboxAddr, peers.SandboxRouter(conns).DialOption())
	if err != nil {
		return service.Deps{}, fmt.Errorf("sandbox client: %w", err)
	}
	deps := service.Deps{
		Store: store.New(rdb, int64(cfg.EventCap), backstops.NextDeadline), Watchers: store.NewWatchConns(rdb, cfg.WatchPoolSize), Logger: log,
		Sandbox: peers.Sandbox{C: sandboxv1.NewSandboxServiceClient(sbxConn)},
		Metrics: service.NewMetrics(),
	}
	if cfg.CredentialAddr != "" {
		c, err := conns.Dial(cfg.CredentialAddr)
		if err != nil {
			return service.Deps{}, fmt.Errorf("credential client: %w", err)
		}
		deps.Credentials = peers.Credentials{C: credentialv1.NewCredentialServiceClient(c)}
	}
	if cfg.IngestAddr != "" {
		c, err := conns.Dial(cfg.IngestAddr)
		if err != nil {
			return service.Deps{}, fmt.Errorf("ingest client: %w", err)
		}
		deps.History = peers.History{C: ingestv1.NewIngestServiceClient(c)}
	}
	return deps, nil
}
