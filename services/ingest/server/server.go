// Package server runs the ingest service: configuration, wiring and the serve loop. It is
// public so that cmd/agentplane can run every service in one process.
package server

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"time"

	"agentplane.dev/pkg/grpcclient"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/pkg/telemetry"
	"agentplane.dev/services/ingest/internal/grpcapi"
	"agentplane.dev/services/ingest/internal/membership"
	"agentplane.dev/services/ingest/internal/store"
)

// Config is the ingest service's configuration.
type Config struct {
	config.Common
	CredentialAddr string        // CREDENTIAL_ADDR: the credential service, asked about v2 scope membership
	TombstoneTTL   time.Duration // INGEST_TOMBSTONE_TTL: how long a deleted runtime session's tombstone stays
}

// DefaultConfig returns the dev defaults (ports of docs/development.md).
func DefaultConfig() Config {
	return Config{
		Common:         config.DefaultCommon("127.0.0.1:7404", "127.0.0.1:9404"),
		CredentialAddr: "127.0.0.1:7403",
		TombstoneTTL:   store.DefaultTombstoneTTL,
	}
}

// Bind registers every setting on l, with c's current values as defaults.
func (c *Config) Bind(l *config.Loader) {
	c.Common.Bind(l)
	l.String(&c.CredentialAddr, "CREDENTIAL_ADDR", c.CredentialAddr, "credential service gRPC address (v2 scope membership checks); "+config.PeerAddrHelp)
	l.Duration(&c.TombstoneTTL, "INGEST_TOMBSTONE_TTL", c.TombstoneTTL, "how long a deleted runtime session's tombstone refuses late writes (the longest grant lifetime plus the longest retry)")
}

// Validate reports every bad setting, naming its variable and flag.
func (c *Config) Validate() error {
	errs := []error{c.Common.Validate()}
	errs = append(errs, config.CheckPeerAddr("CREDENTIAL_ADDR", c.CredentialAddr, true))
	if c.TombstoneTTL < time.Minute {
		errs = append(errs, config.ErrorFor("INGEST_TOMBSTONE_TTL", errors.New("must be at least 1m")))
	}
	return errors.Join(errs...)
}

// LoadConfig reads the environment and args over the defaults and validates the result.
func LoadConfig(args []string, lookupEnv func(string) (string, bool)) (Config, error) {
	cfg := DefaultConfig()
	fs := flag.NewFlagSet("ingest", flag.ContinueOnError)
	l := config.NewLoader(fs, lookupEnv)
	cfg.Bind(l)
	if err := l.Parse(args); err != nil {
		return Config{}, err
	}
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// Listeners lets a caller (tests, agentplane dev) pass bound listeners;
// nil fields listen on the configured addresses.
type Listeners struct {
	GRPC, Metrics net.Listener
}

// Run serves the ingest service until ctx ends; nil after a clean drain.
func Run(ctx context.Context, cfg Config) error { return RunWith(ctx, cfg, Listeners{}) }

// RunWith is Run on given listeners.
func RunWith(ctx context.Context, cfg Config, ls Listeners) error {
	log := cfg.Logger().With("service", "ingest")
	tel, err := telemetry.Setup(ctx, "agentplane-ingest")
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
	}
	// Serve flushes telemetry and closes Redis in its shutdown order; these
	// defers cover every earlier return and are no-ops after Serve.
	defer func() { _ = tel.Shutdown(context.WithoutCancel(ctx)) }()
	rdb, err := cfg.Redis()
	if err != nil {
		return config.ErrorFor("REDIS_URL", err)
	}
	defer func() { _ = rdb.Close() }()
	credential, err := grpcclient.Dial(cfg.CredentialAddr, cfg.InternalToken)
	if err != nil {
		return config.ErrorFor("CREDENTIAL_ADDR", err)
	}
	defer func() { _ = credential.Close() }()

	srv, err := grpcserver.New(grpcserver.Options{
		Name: "ingest", Logger: log, Redis: rdb, Telemetry: tel,
		Addr: cfg.GRPCAddr, Listener: ls.GRPC, MetricsAddr: cfg.MetricsAddr, MetricsListener: ls.Metrics,
		InternalToken: cfg.InternalToken, DrainDelay: cfg.DrainDelay, ShutdownTimeout: cfg.ShutdownTimeout,
		ServerOptions: grpcapi.ServerOptions(),
	})
	if err != nil {
		return err
	}
	st := store.New(rdb)
	st.TombstoneTTL = cfg.TombstoneTTL
	api := grpcapi.New(st, membership.New(credential), log)
	m, err := grpcapi.NewMetrics(srv.Registry())
	if err != nil {
		return err
	}
	api.Observe(m)
	api.Register(srv)
	return srv.Serve(ctx)
}

// ServerOptions are the transport settings the ingest service wants from the gRPC server it
// is registered on (flow-control windows that hold whole batches).
func ServerOptions() []grpc.ServerOption { return grpcapi.ServerOptions() }

// Register registers the ingest service on reg, storing in rdb and asking the credential
// service on credential about v2 scope membership. cmd/agentplane composes with it.
func Register(reg grpc.ServiceRegistrar, rdb redis.UniversalClient, credential grpc.ClientConnInterface, log *slog.Logger) {
	grpcapi.New(store.New(rdb), membership.New(credential), log).Register(reg)
}
