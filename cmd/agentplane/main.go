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
  agentplane run [flags] "prompt"   create a session, send the prompt, follow the turn (agentplane run -h)
  agentplane session <verb> ...     sessions for people: create, get, list, send, watch, changes, push,
                                    files, cat, put, egress, stop, suspend, resume, delete, export,
                                    usage (agentplane session -h)
  agentplane dev [flags]            all four services in one process (agentplane dev -h)
  agentplane serve <service> [flags]
                                    run one service: session, sandbox, credential or ingest
                                    (agentplane serve <service> -h lists its flags); the image's
                                    workloads run these (agentplane sandbox|credential|ingest work too)
  agentplane wrapper [flags]        the in-sandbox wrapper (launched by the sandbox service)
  agentplane runtime scripted       the built-in scripted agent runtime (launched by the wrapper)
  agentplane --version              the version this binary was built from

Every service flag can also be set with an AGENTPLANE_* environment variable.
Exit codes: 0 done (and for -h), 1 failed, 2 a usage error or a refused request, 130 interrupted.
`

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "-h", "--help", "-help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	case "--version", "-version", "version":
		if len(args) > 1 {
			fmt.Fprintf(stderr, "agentplane %s: unexpected argument %q (it takes none)\n", args[0], args[1])
			return 2
		}
		fmt.Fprintln(stdout, versionLine())
		return 0
	}
	if cli.Handles(args) {
		return cli.Main(args, stdout, stderr)
	}
	if code, ok := wrapperHelp(args, stdout); ok {
		return code
	}
	if code, ok := wrapper.Subcommand(args); ok {
		return code
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "runtime":
		fmt.Fprintln(stderr, "usage: agentplane runtime scripted")
		return 2
	case "serve":
		if len(rest) == 0 || !isService(rest[0]) {
			return serveUsage(rest, stdout, stderr)
		}
		cmd, rest = rest[0], rest[1:]
	case "dev", "sandbox", "credential", "ingest":
	default:
		fmt.Fprintf(stderr, "agentplane: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	if len(rest) > 0 && rest[0] == "help" {
		// `agentplane dev help` as `agentplane help` and `agentplane session help`.
		rest = []string{"-h"}
	}
	if code, done := helpOrBadFlags(cmd, rest, stdout, stderr); done {
		return code
	}

	switch cmd {
	case "dev", "session", "sandbox", "credential", "ingest":
		// Before any secret is read: no other process of this uid may read our memory or
		// environment. (The wrapper, above, makes itself non-dumpable behind the boundary, where
		// its service finds it by its bubblewrap's markers; without one it stays dumpable: it is
		// the process whose markers its service reads.)
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
	}
	if err != nil {
		fmt.Fprintf(stderr, "agentplane %s: %v\n", cmd, err)
		return 1
	}
	return 0
}
