// Package cli is the command line for people: `agentplane run` and
// `agentplane session <verb>`, built on the Go client (agentplane.dev/client).
//
// Exit codes: 0 done (a run's turn succeeded; help asked for with -h), 1 a
// run's turn failed or was cancelled by someone else, 2 bad input or an
// error (one line on stderr), 130 interrupted (Ctrl-C).
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/client"
	"agentplane.dev/pkg/apierr"
)

// Exit codes.
const (
	exitOK          = 0
	exitFailed      = 1
	exitUsage       = 2
	exitInterrupted = 130
)

// sessionVerbs are the verbs of `agentplane session`, with their one-line
// help, in the order `agentplane session -h` lists them.
var sessionVerbs = []struct{ name, args, help string }{
	{"create", "[flags]", "create a session (--dir, --repo, --agent, --egress, --suspend-after, --git-token-file, --git-push-prefix)"},
	{"get", "ID", "show a session"},
	{"list", "[--org O] [--user U]", "list sessions"},
	{"send", `ID "text"`, "send a message (its turn runs in the background)"},
	{"watch", "ID [--from CURSOR]", "follow a session's events until Ctrl-C"},
	{"changes", "ID", "show the worktree's changed files and diff"},
	{"push", "ID --branch B [--message M]", "commit the worktree's changes and push them to a branch"},
	{"files", "ID [DIR]", "list a directory of the worktree (default: its root)"},
	{"cat", "ID PATH", "print a file of the worktree"},
	{"put", "ID PATH [FILE] [--mode M] [--force]", "write a file of the worktree from FILE or stdin"},
	{"egress", "ID [--allow host[:port],...]", "show the session's egress allowlist, or replace it with --allow's"},
	{"stop", "ID", "stop a session's work"},
	{"suspend", "ID [--force]", "stop the session's agent, keeping its workspace and conversation"},
	{"resume", "[--restart] ID", "start the session's agent again (any message does too); --restart: a new conversation when its state was lost"},
	{"delete", "ID [--timeout D]", "delete a session (waits through a pending cleanup)"},
	{"export", "ID", "print the session's whole history (every runtime session of it, in order)"},
	{"usage", "ID", "show the session's provider tokens, requests, model and cost so far"},
	{"audit", "ID [--turn M]", "list the session's audit records (proxied requests, egress decisions), each with its turn"},
}

// sessionUsage lists the verbs of `agentplane session`.
func sessionUsage() string {
	var b strings.Builder
	b.WriteString("usage: agentplane session <verb> [flags] [arguments]\n\nverbs:\n")
	for _, v := range sessionVerbs {
		fmt.Fprintf(&b, "  %-8s %-30s %s\n", v.name, v.args, v.help)
	}
	b.WriteString("\nagentplane session <verb> -h lists a verb's flags. The session service itself is\n`agentplane serve session`.\n")
	return b.String()
}

// Handles reports whether args (after the binary name) are a CLI command:
// `run` or `session` (with any verb, a wrong one included: it is a usage
// error, never the session service).
func Handles(args []string) bool {
	return len(args) > 0 && (args[0] == "run" || args[0] == "session")
}

// Main runs a CLI command (args start with "run" or "session") and returns
// the exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	e := &env{stdout: stdout, stderr: stderr, lookup: os.LookupEnv}
	if args[0] == "run" {
		e.name = "agentplane run"
		return e.run(args[1:])
	}
	if len(args) < 2 {
		fmt.Fprint(stderr, sessionUsage())
		return exitUsage
	}
	switch verb := args[1]; {
	case verb == "-h" || verb == "--help" || verb == "-help" || verb == "help":
		fmt.Fprint(stdout, sessionUsage())
		return exitOK
	case !slices.ContainsFunc(sessionVerbs, func(v struct{ name, args, help string }) bool { return v.name == verb }):
		fmt.Fprintf(stderr, "agentplane session: unknown verb %q (agentplane session -h lists the verbs)\n", verb)
		return exitUsage
	}
	e.name = "agentplane session " + args[1]
	return e.session(args[1], args[2:])
}

// env is what every command shares: its name, output and connection flags.
type env struct {
	name           string
	stdout, stderr io.Writer
	lookup         func(string) (string, bool)

	usage  func()
	addr   string
	output string
	tls    bool
}

// flags returns a flag set with the shared flags: --addr, --output, --tls.
func (e *env) flags(usage string) *flag.FlagSet {
	fs := flag.NewFlagSet(e.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported in one line by fail
	fs.StringVar(&e.addr, "addr", e.env("AGENTPLANE_ADDR", client.DefaultAddr), "session service address (env AGENTPLANE_ADDR; the default is agentplane dev's)")
	fs.StringVar(&e.output, "output", "human", "human, or json: one protojson object per line")
	fs.BoolVar(&e.tls, "tls", false, "dial with TLS (system roots); the token, if any, comes from AGENTPLANE_INTERNAL_TOKEN")
	// flag calls Usage on every parse error too; help is printed by parse.
	fs.Usage = func() {}
	e.usage = func() {
		fmt.Fprintf(e.stdout, "usage: %s %s\n\nflags:\n", e.name, usage)
		fs.SetOutput(e.stdout)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// parse parses flags anywhere among the arguments (`run "hi" --dir x` and
// `run --dir x "hi"` alike; everything after "--" is positional) and returns
// the positional ones. ok is false when the command must end with code.
func (e *env) parse(fs *flag.FlagSet, args []string, npos int) (pos []string, code int, ok bool) {
	var tail []string
	for i, a := range args {
		if a == "--" {
			args, tail = args[:i], args[i+1:]
			break
		}
	}
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				e.usage()
				return nil, exitOK, false
			}
			return nil, e.fail(fmt.Errorf("%w (%s -h lists the flags)", err, e.name)), false
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos, args = append(pos, args[0]), args[1:]
	}
	pos = append(pos, tail...)
	if e.output != "human" && e.output != "json" {
		return nil, e.fail(fmt.Errorf("--output %q: want human or json", e.output)), false
	}
	if e.addr == "" {
		return nil, e.fail(errors.New("--addr is empty")), false
	}
	if npos >= 0 && len(pos) != npos {
		return nil, e.fail(fmt.Errorf("want %d argument(s), got %d (%s -h)", npos, len(pos), e.name)), false
	}
	return pos, 0, true
}

// env returns the environment variable name, or def when it is unset or empty.
func (e *env) env(name, def string) string {
	if v, ok := e.lookup(name); ok && v != "" {
		return v
	}
	return def
}

func (e *env) dial(extra ...client.Option) (*client.Client, error) {
	opts := extra
	if tok, ok := e.lookup("AGENTPLANE_INTERNAL_TOKEN"); ok && tok != "" {
		opts = append(opts, client.WithToken(tok))
	} else if st, ok := readDevState(e.addr); ok && st.InternalToken != "" {
		opts = append(opts, client.WithToken(st.InternalToken))
	}
	if e.tls {
		opts = append(opts, client.WithTLS(nil))
	}
	return client.Dial(e.addr, opts...)
}

// fail writes err as one line on stderr and returns the usage exit code.
func (e *env) fail(err error) int {
	fmt.Fprintf(e.stderr, "%s: %s\n", e.name, e.describe(err))
	return exitUsage
}

// describe turns an error into one line for a person: the server's message
// and reason, or what went wrong reaching it.
func (e *env) describe(err error) string {
	if errors.Is(err, context.DeadlineExceeded) && apierr.Info(err) == nil {
		return "timed out waiting for the session service at " + e.addr
	}
	st, ok := status.FromError(err)
	if !ok {
		return oneLineText(err.Error())
	}
	info := apierr.Info(err)
	if info == nil {
		// A deadline that passed while no connection could be made says so
		// in its message ("... last connection error: ...").
		if st.Code() == codes.Unavailable || st.Code() == codes.DeadlineExceeded && strings.Contains(st.Message(), "connection error") {
			return fmt.Sprintf("cannot reach the session service at %s (is `agentplane dev` running? --addr or AGENTPLANE_ADDR sets the address): %s",
				e.addr, transportCause(st.Message()))
		}
		if st.Code() == codes.DeadlineExceeded {
			return "the deadline passed before the session service at " + e.addr + " answered"
		}
		return fmt.Sprintf("%s: %s", st.Code(), oneLineText(st.Message()))
	}
	msg := st.Message()
	var fields []string
	for _, v := range apierr.FieldViolations(err) {
		// Said once: a message that names the field and why already
		// ("invalid worktree.repo_url: an http(s) repository URL ...").
		if f := v.GetField() + ": " + v.GetDescription(); !strings.Contains(msg, f) {
			fields = append(fields, f)
		}
	}
	if len(fields) > 0 {
		msg += " (" + strings.Join(fields, "; ") + ")"
	}
	if step := info.GetMetadata()["pending_step"]; step != "" {
		msg += " (pending: " + step + ")"
	}
	if info.GetReason() == "AGENT_UNAVAILABLE" {
		msg += "; `make agents` installs the pinned opencode and kilo (agentplane dev finds them in ./agents, or give it --agents-dir)"
	}
	return fmt.Sprintf("%s [%s]", oneLineText(msg), info.GetReason())
}

// transportCause keeps the end of a gRPC transport message ("... dial tcp
// 127.0.0.1:1: connect: connection refused" → "connection refused").
func transportCause(msg string) string {
	msg = strings.Trim(msg, `"`)
	if i := strings.LastIndex(msg, ": "); i >= 0 {
		return strings.Trim(msg[i+2:], `"`)
	}
	return oneLineText(msg)
}

func oneLineText(s string) string { return strings.Join(strings.Fields(s), " ") }

// callTimeout bounds each unary command.
const callTimeout = 30 * time.Second
