package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"strings"

	credential "agentplane.dev/services/credential/server"
	ingest "agentplane.dev/services/ingest/server"
	sandbox "agentplane.dev/services/sandbox/server"
	"agentplane.dev/services/sandbox/wrapper"
	session "agentplane.dev/services/session/server"
)

// version is set at link time by the image build (-X main.version=...);
// empty: the module version of the build information.
var version string

// commit is set at link time by `make build` (-X main.commit=...): the
// build information of a go.work workspace build records no commit.
var commit string

// versionLine is `agentplane --version`: the version, the commit and its
// time when the build recorded them (go build in a git checkout does), and
// the Go release.
func versionLine() string {
	v, rev, at, modified := version, "", "", false
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v == "" {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.time":
				at = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if v == "" {
		v = "(devel)"
	}
	if rev == "" && commit != "" {
		rev, modified = strings.TrimSuffix(commit, "+modified"), strings.HasSuffix(commit, "+modified")
	}
	parts := []string{"agentplane", v}
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if modified {
			rev += "+modified"
		}
		parts = append(parts, "commit "+rev)
	}
	if at != "" {
		parts = append(parts, at)
	}
	return strings.Join(append(parts, runtime.Version(), runtime.GOOS+"/"+runtime.GOARCH), " ")
}

// services maps `agentplane serve <name>` to the service's configuration
// loader (which parses its flags and AGENTPLANE_* variables).
var services = map[string]func([]string) error{
	"session":    func(a []string) error { _, err := session.LoadConfig(a, os.LookupEnv); return err },
	"sandbox":    func(a []string) error { _, err := sandbox.LoadConfig(a, os.LookupEnv); return err },
	"credential": func(a []string) error { _, err := credential.LoadConfig(a, os.LookupEnv); return err },
	"ingest":     func(a []string) error { _, err := ingest.LoadConfig(a, os.LookupEnv); return err },
}

func isService(name string) bool { _, ok := services[name]; return ok }

// serveUsage answers `agentplane serve` without a service: help on -h,
// else a usage error.
func serveUsage(rest []string, stdout, stderr io.Writer) int {
	const text = "usage: agentplane serve session|sandbox|credential|ingest [flags]\n\nagentplane serve <service> -h lists the service's flags.\n"
	if len(rest) > 0 && isHelp(rest[0]) {
		fmt.Fprint(stdout, text)
		return 0
	}
	if len(rest) > 0 {
		fmt.Fprintf(stderr, "agentplane serve: unknown service %q\n", rest[0])
	}
	fmt.Fprint(stderr, text)
	return 2
}

// wrapperHelp answers -h of `wrapper` and `runtime scripted` on stdout with
// exit 0, as every other command does (their own flag sets print on stderr
// and exit 2).
func wrapperHelp(args []string, stdout io.Writer) (int, bool) {
	n := 1
	if len(args) > 1 && args[0] == "runtime" && args[1] == "scripted" {
		n = 2
	} else if args[0] != "wrapper" {
		return 0, false
	}
	for _, a := range args[n:] {
		if a == "--" {
			break
		}
		if isHelp(a) {
			_ = withStderr(stdout, func() error { wrapper.Subcommand(append(args[:n:n], "-h")); return nil })
			return 0, true
		}
	}
	return 0, false
}

func isHelp(a string) bool {
	return a == "-h" || a == "--help" || a == "-help" || a == "help"
}

// helpOrBadFlags answers -h (the flags, on stdout, exit 0) and a bad flag or
// setting (one line, exit 2) before anything starts. done is false when the
// command should run.
func helpOrBadFlags(cmd string, args []string, stdout, stderr io.Writer) (code int, done bool) {
	name := "agentplane serve " + cmd
	check := services[cmd]
	if cmd == "dev" {
		name = "agentplane dev"
		check = func(a []string) error { _, err := parseDev(a); return err }
	}
	// The flag sets print their usage on os.Stderr, which they read when
	// they print: the parse whose result counts prints nowhere.
	err := withStderr(io.Discard, func() error { return check(args) })
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "usage: %s [flags]\n\n", name)
		if cmd != "dev" {
			fmt.Fprintln(stdout, "Every flag can also be set with the AGENTPLANE_* variable named after it.")
		}
		_ = withStderr(stdout, func() error { return check(args) })
		return 0, true
	case err != nil:
		// A bad flag, or a setting missing or wrong: one line, nothing started.
		fmt.Fprintf(stderr, "%s: %s (%s -h lists the flags)\n", name, strings.Join(strings.Fields(err.Error()), " "), name)
		return 2, true
	}
	return 0, false
}

// withStderr runs fn with os.Stderr sent to w (through a pipe).
func withStderr(w io.Writer, fn func() error) error {
	r, pw, err := os.Pipe()
	if err != nil {
		return fn()
	}
	copied := make(chan struct{})
	go func() { _, _ = io.Copy(w, r); close(copied) }()
	old := os.Stderr
	os.Stderr = pw
	err = fn()
	os.Stderr = old
	_ = pw.Close()
	<-copied
	_ = r.Close()
	return err
}

// serve loads one service's configuration (failing fast on a bad value) and runs it.
func serve[C any](args []string, load func([]string, func(string) (string, bool)) (C, error), runService func(C) error) error {
	cfg, err := load(args, os.LookupEnv)
	if err != nil {
		return err
	}
	return runService(cfg)
}
