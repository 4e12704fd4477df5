// Command session runs the session service.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"agentplane.dev/services/session/server"
)

func main() {
	cfg, err := server.LoadConfig(os.Args[1:], os.LookupEnv)
	if err != nil {
		fmt.Fprintln(os.Stderr, "session:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := server.Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "session:", err)
		os.Exit(1)
	}
}
