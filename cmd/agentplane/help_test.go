package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// runBin runs bin with args in an environment without AGENTPLANE_*
// settings and returns its output and exit code.
func runBin(t *testing.T, bin string, args ...string) cliResult {
	t.Helper()
	return runBinEnv(t, bin, nil, args...)
}

// runBinEnv is runBin with the AGENTPLANE_* settings of env. A command
// that has not exited after a minute is killed (a service started: the
// callers assert it did not).
func runBinEnv(t *testing.T, bin string, env []string, args ...string) cliResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "AGENTPLANE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	_ = cmd.Run()
	return cliResult{stdout: stdout.String(), stderr: stderr.String(), code: cmd.ProcessState.ExitCode()}
}

// TestHelpAndUsageErrors (issue 36): every command answers -h on stdout with
// exit 0 and a wrong verb, command or flag with a message on stderr and
// exit 2; none of them starts a service (a service would fail on the
// missing AGENTPLANE_REDIS_URL, and say so).
func TestHelpAndUsageErrors(t *testing.T) {
	bin := builtWithVersion(t)
	for _, args := range [][]string{
		{"-h"}, {"--help"}, {"help"},
		{"run", "-h"}, {"session", "-h"}, {"session", "--help"},
		{"session", "create", "-h"}, {"session", "get", "-h"}, {"session", "list", "-h"}, {"session", "send", "-h"},
		{"session", "watch", "-h"}, {"session", "changes", "-h"}, {"session", "push", "-h"}, {"session", "egress", "-h"},
		{"session", "files", "-h"}, {"session", "cat", "-h"}, {"session", "put", "-h"}, {"session", "stop", "-h"}, {"session", "delete", "-h"},
		{"session", "suspend", "-h"}, {"session", "resume", "-h"}, {"session", "export", "-h"}, {"session", "usage", "-h"},
		{"dev", "-h"}, {"dev", "--help"}, {"dev", "help"}, {"serve", "session", "help"}, {"ingest", "help"}, {"session", "help"},
		{"serve", "-h"}, {"serve", "session", "-h"}, {"serve", "sandbox", "-h"}, {"serve", "credential", "-h"}, {"serve", "ingest", "-h"},
		{"sandbox", "-h"}, {"credential", "-h"}, {"ingest", "-h"},
		{"wrapper", "-h"}, {"runtime", "scripted", "-h"},
	} {
		r := runBin(t, bin, args...)
		require.Equal(t, 0, r.code, "%v: exit 0 for help\nstderr: %s", args, r.stderr)
		require.Empty(t, r.stderr, "%v: help goes to stdout", args)
		require.NotEmpty(t, r.stdout, "%v", args)
		require.NotContains(t, r.stdout, "REDIS_URL): required", "%v started a service", args)
	}

	// With every required setting present, "help" and a stray argument still start nothing.
	settings := []string{"AGENTPLANE_REDIS_URL=redis://127.0.0.1:1", "AGENTPLANE_GRPC_ADDR=127.0.0.1:0", "AGENTPLANE_METRICS_ADDR="}
	for _, args := range [][]string{{"serve", "ingest", "help"}, {"ingest", "help"}, {"serve", "ingest", "stray"}, {"serve", "ingest", "--drain-delay", "0s", "stray"}} {
		r := runBinEnv(t, bin, settings, args...)
		require.NotContains(t, r.stdout+r.stderr, "serving", "%v started the service", args)
		if args[len(args)-1] == "help" {
			require.Equal(t, 0, r.code, "%v: help\nstderr: %s", args, r.stderr)
			require.Contains(t, r.stdout, "usage: agentplane serve ingest [flags]")
			continue
		}
		require.Equal(t, 2, r.code, "%v: a usage error\nstderr: %s", args, r.stderr)
		require.Equal(t, "agentplane serve ingest: unexpected argument \"stray\" (a service takes only flags) (agentplane serve ingest -h lists the flags)\n", r.stderr)
	}

	r := runBin(t, bin, "session", "-h")
	top := runBin(t, bin, "-h")
	for _, verb := range []string{"create", "get", "list", "send", "watch", "changes", "push", "files", "cat", "put", "egress",
		"stop", "suspend", "resume", "delete", "export", "usage"} {
		require.Regexp(t, `(?m)^  `+verb+` `, r.stdout, "session -h lists the verb %s", verb)
		require.Regexp(t, `\b`+verb+`\b`, top.stdout[strings.Index(top.stdout, "agentplane session"):strings.Index(top.stdout, "agentplane dev")],
			"agentplane -h names the session verb %s", verb)
	}
	require.NotContains(t, r.stdout, "redis-url", "session -h lists the verbs, not the service's flags")
	r = runBin(t, bin, "serve", "session", "-h")
	require.Contains(t, r.stdout, "-redis-url", "serve session -h lists the service's flags")

	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "Usage:"},
		{[]string{"frob"}, `unknown command "frob"`},
		{[]string{"session"}, "usage: agentplane session <verb>"},
		{[]string{"session", "frob"}, `agentplane session: unknown verb "frob"`},
		{[]string{"session", "--redis-url", "redis://x"}, `unknown verb "--redis-url"`},
		{[]string{"serve"}, "usage: agentplane serve"},
		{[]string{"serve", "frob"}, `unknown service "frob"`},
		{[]string{"serve", "session", "--bogus"}, "agentplane serve session: flag provided but not defined: -bogus"},
		{[]string{"serve", "session"}, "agentplane serve session: AGENTPLANE_REDIS_URL (--redis-url): required"},
		{[]string{"dev", "--bogus"}, "agentplane dev: flag provided but not defined: -bogus"},
		{[]string{"dev", "stray"}, `agentplane dev: unexpected argument "stray"`},
		{[]string{"run", "--bogus", "x"}, "flag provided but not defined: -bogus"},
		{[]string{"session", "push", "ses-1"}, "--branch is required"},
		{[]string{"session", "usage"}, "agentplane session usage: want 1 argument(s), got 0"},
		{[]string{"runtime"}, "usage: agentplane runtime scripted"},
		{[]string{"--version", "extra"}, `agentplane --version: unexpected argument "extra"`},
		// A service takes only flags: a stray argument (and every flag after it) is not ignored.
		{[]string{"serve", "ingest", "stray", "--grpc-addr", "127.0.0.1:1"}, `agentplane serve ingest: unexpected argument "stray"`},
	} {
		r := runBin(t, bin, tc.args...)
		require.Equal(t, 2, r.code, "%v: exit 2 for a usage error\nstderr: %s", tc.args, r.stderr)
		require.Empty(t, r.stdout, "%v", tc.args)
		require.Contains(t, r.stderr, tc.want, "%v", tc.args)
		require.NotContains(t, r.stderr, "listening", "%v started a service", tc.args)
	}
}

// TestVersion: --version reads the build information: the version linked in
// by the image build (-X main.version), the commit (builds in a go.work
// workspace record none: make build links it in, -X main.commit), the Go
// release it was built with.
func TestVersion(t *testing.T) {
	bin := builtWithVersion(t)
	for _, flag := range []string{"--version", "version"} {
		r := runBin(t, bin, flag)
		require.Equal(t, 0, r.code)
		require.Empty(t, r.stderr)
		require.Regexp(t, `^agentplane v9\.8\.7-test commit 0123456789ab\+modified (\S+ )?`+
			regexp.QuoteMeta(runtime.Version())+` linux/\w+\n$`, r.stdout)
	}
}

var versionBuild struct {
	once sync.Once
	bin  string
	err  error
}

// builtWithVersion builds the binary once for this file's tests, as the
// image does (a version linked in).
func builtWithVersion(t *testing.T) string {
	versionBuild.once.Do(func() {
		dir, err := os.MkdirTemp("", "agentplane-help-test-")
		if err != nil {
			versionBuild.err = err
			return
		}
		versionBuild.bin = filepath.Join(dir, "agentplane")
		build := exec.Command("go", "build", "-ldflags", "-X main.version=v9.8.7-test -X main.commit=0123456789abcdef+modified", "-o", versionBuild.bin, ".")
		build.Stderr = os.Stderr
		versionBuild.err = build.Run()
	})
	require.NoError(t, versionBuild.err, "build agentplane")
	return versionBuild.bin
}
