package grpcserver_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/pkg/telemetry"
)

// A service main: config from env and flags, fail fast, serve until SIGTERM, exit 0.
func Example() {
	cfg := config.DefaultCommon("127.0.0.1:7401", "127.0.0.1:9401")
	loader := config.NewLoader(flag.CommandLine, os.LookupEnv)
	cfg.Bind(loader) // a service binds its own settings on the same loader
	if err := loader.Parse(os.Args[1:]); err != nil || cfg.Validate() != nil {
		fmt.Fprintln(os.Stderr, "config:", err, cfg.Validate())
		os.Exit(2)
	}
	log := cfg.Logger()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	tel, err := telemetry.Setup(ctx, "session")
	if err != nil {
		log.Error("telemetry", "error", err)
		os.Exit(2)
	}
	rdb, _ := config.Redis(cfg.RedisURL) // already checked by Validate
	srv, err := grpcserver.New(grpcserver.Options{
		Name: "session", Logger: log, Redis: rdb, Telemetry: tel,
		Addr: cfg.GRPCAddr, MetricsAddr: cfg.MetricsAddr, InternalToken: cfg.InternalToken,
		DrainDelay: cfg.DrainDelay, ShutdownTimeout: cfg.ShutdownTimeout,
	})
	if err != nil {
		log.Error("server", "error", err)
		os.Exit(2)
	}
	// sessionv1.RegisterSessionServiceServer(srv, handlers)
	if err := srv.Serve(ctx); err != nil {
		log.Error("serve", "error", err)
		os.Exit(1)
	}
}
