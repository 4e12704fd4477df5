// Command agentplane is the all-in-one binary: each service, the wrapper, the
// scripted runtime, and `agentplane dev`, which runs the whole suite in one
// process for local use.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"agentplane.dev/cmd/agentplane/internal/cli"
	"agentplane.dev/pkg/nodump"
	credential "agentplane.dev/services/credential/server"
	ingest "agentplane.dev/services/ingest/server"
	sandbox "agentplane.dev/services/sandbox/server"
	"agentplane.dev/services/sandbox/wrapper"
	session "agentplane.dev/services/session/server"
)

const usage = `agentplane runs cloud coding-agent sessions.

Usage:
  agentplane run [flags] "prompt" create a session, send the prompt, follow the turn (agentplane run -h)
  agentplane session create|get|list|send|watch|stop|delete ...
                                  sessions for people, on the SessionService (agentplane session get -h)
  agentplane dev [flags]          all four services in one process (see agentplane dev -h)
  agentplane session [flags]      the session service (public SessionService)
  agentplane sandbox [flags]      the sandbox service (process provider)
  agentplane credential [flags]   the credential service and its HTTP proxy
  agentplane ingest [flags]       the ingest service
  agentplane wrapper [flags]      the in-sandbox wrapper (launched by the sandbox service)
  agentplane runtime scripted     the built-in scripted agent runtime (launched by the wrapper)

Every service flag can also be set with an AGENTPLANE_* environment variable;
run "agentplane <service> -h" to list them.
`

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	if cli.Handles(args) {
		return cli.Main(args, stdout, stderr)
	}
	if code, ok := wrapper.Subcommand(args); ok {
		return code
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "runtime":
		fmt.Fprintln(stderr, "usage: agentplane runtime scripted")
		return 2
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}

	switch cmd {
	case "dev", "session", "sandbox", "credential", "ingest":
		// Before any secret is read: no other process of this uid may read our memory or
		// environment. (The wrapper, above, stays dumpable: its sandbox service reads its markers.)
		if err := nodump.Set(); err != nil {
			fmt.Fprintf(stderr, "agentplane %s: %v\n", cmd, err)
			return 1
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var err error
	switch cmd {
	case "dev":
		err = runDev(ctx, rest, stdout, stderr)
	case "session":
		err = serve(rest, session.LoadConfig, func(c session.Config) error { return session.Run(ctx, c) })
	case "sandbox":
		err = serve(rest, sandbox.LoadConfig, func(c sandbox.Config) error { return sandbox.Run(ctx, c) })
	case "credential":
		err = serve(rest, credential.LoadConfig, func(c credential.Config) error { return credential.Run(ctx, c) })
	case "ingest":
		err = serve(rest, ingest.LoadConfig, func(c ingest.Config) error { return ingest.Run(ctx, c) })
	default:
		fmt.Fprintf(stderr, "agentplane: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "agentplane %s: %v\n", cmd, err)
		return 1
	}
	return 0
}

// serve loads one service's configuration (failing fast on a bad value) and runs it.
func serve[C any](args []string, load func([]string, func(string) (string, bool)) (C, error), runService func(C) error) error {
	cfg, err := load(args, os.LookupEnv)
	if err != nil {
		return err
	}
	return runService(cfg)
}
