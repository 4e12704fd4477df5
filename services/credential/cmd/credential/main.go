// Command credential runs the credential service and its HTTP proxy.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"agentplane.dev/pkg/nodump"
	"agentplane.dev/services/credential/server"
)

func main() {
	// Before any secret is read: no other process of this uid may read our memory or environment.
	if err := nodump.Set(); err != nil {
		fmt.Fprintln(os.Stderr, "credential:", err)
		os.Exit(2)
	}
	cfg, err := server.LoadConfig(os.Args[1:], os.LookupEnv)
	if err != nil {
		fmt.Fprintln(os.Stderr, "credential:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := server.Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "credential:", err)
		os.Exit(1)
	}
}
