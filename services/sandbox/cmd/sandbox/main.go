// Command sandbox runs the sandbox service; `sandbox wrapper ...` runs the
// wrapper and `sandbox runtime scripted` the scripted runtime, so the
// service can launch its own binary for both.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"agentplane.dev/pkg/nodump"
	"agentplane.dev/services/sandbox/server"
	"agentplane.dev/services/sandbox/wrapper"
)

func main() {
	args := os.Args[1:]
	if code, ok := wrapper.Subcommand(args); ok {
		os.Exit(code)
	}
	// Before any secret is read: no other process of this uid may read our memory or environment.
	if err := nodump.Set(); err != nil {
		fmt.Fprintln(os.Stderr, "sandbox:", err)
		os.Exit(2)
	}
	cfg, err := server.LoadConfig(args, os.LookupEnv)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sandbox:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := server.Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "sandbox:", err)
		os.Exit(1)
	}
}
