package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/charmbracelet/x/ansi"
	"github.com/creack/pty"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/gittest"
)

// CLI tests (issue 23): the built agentplane binary against a real suite,
// `agentplane dev` as its own process with a private redis-server, shared
// by the tests of this file (subtests of TestCLI).

var cliSuite struct {
	bin  string
	addr string
	// org makes the suite's sandbox ids its own (one sandbox per org and
	// user): wrappers are found by sandbox id machine-wide, so a developer's
	// own agentplane dev must never share one with the tests.
	org  string
	dir  string
	stop func()
}

// TestCLI starts the suite once and runs every CLI test against it as a
// subtest (go test -run 'TestCLI/run_hello' picks one).
func TestCLI(t *testing.T) {
	t.Cleanup(func() {
		if cliSuite.stop != nil {
			cliSuite.stop()
		}
		if cliSuite.dir != "" {
			_ = os.RemoveAll(cliSuite.dir)
		}
		cliSuite.bin, cliSuite.addr = "", ""
	})
	require.NoError(t, startCLISuite(t), "start the suite")
	for _, tc := range []struct {
		name string
		test func(*testing.T)
	}{
		{"run_hello", cliRunHelloPrintsTheReply},
		{"run_fail", cliRunFailedTurnExits1WithTheReason},
		{"run_json", cliRunJSONLinesMatchWatchSession},
		{"run_interrupt", cliRunInterruptCancelsTheMessage},
		{"run_terminal", cliRunShowsAProgressLineOnATerminal},
		{"run_timeout", cliRunTimeoutGivesUp},
		{"bad_input", cliBadInputIsOneLineAndExit2},
		{"session_verbs", cliSessionVerbs},
		{"agent_flag", cliAgentFlag},
		{"run_timeout_before_create", cliRunTimeoutBeforeTheSessionIsCreated},
		{"git_token", cliGitTokenClonesTheRepository},
		{"changes_push_egress", cliChangesPushEgress},
		{"git_push_prefix", cliGitPushPrefix},
		{"files_cat", cliFilesCat},
		{"usage", cliUsage},
		{"audit", cliAudit},
	} {
		t.Run(tc.name, tc.test)
	}
}

// suiteForCLI returns the binary and the address of TestCLI's suite.
func suiteForCLI(t *testing.T) (bin, addr string) {
	t.Helper()
	require.NotEmpty(t, cliSuite.addr, "CLI tests run as subtests of TestCLI")
	return cliSuite.bin, cliSuite.addr
}

func startCLISuite(t *testing.T) error {
	dir, err := os.MkdirTemp("", "agentplane-cli-test-")
	if err != nil {
		return err
	}
	cliSuite.dir = dir
	cliSuite.bin = filepath.Join(dir, "agentplane")
	if err := buildBinaries(dir); err != nil {
		return err
	}
	base := freePortBase(t)
	cliSuite.addr = fmt.Sprintf("127.0.0.1:%d", base)
	cliSuite.org = fmt.Sprintf("cli-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	cmd := exec.Command(cliSuite.bin, "dev", "--port-base", strconv.Itoa(base), "--drain-delay", "0s",
		"--shutdown-timeout", "3s", "--sandbox-root", filepath.Join(dir, "sandboxes"))
	// The tests' git http-backend is on loopback, which the git route refuses
	// unless it is named as an in-house git server.
	// A price table, so usage has a cost (every model: 1 and 2 USD per 1M tokens).
	cmd.Env = append(os.Environ(), "AGENTPLANE_PROXY_GIT_PRIVATE_NETWORKS=127.0.0.1",
		`AGENTPLANE_SESSION_PRICE_TABLE={"*":{"input":1,"output":2}}`)
	logs, err := os.Create(filepath.Join(dir, "dev.log"))
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	cliSuite.stop = func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(60 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		_ = logs.Close()
	}
	conn, err := grpc.NewClient(cliSuite.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	waitServing(t, conn, cliSuite.addr)
	return nil
}

// cliResult is what one run of the binary did.
type cliResult struct {
	stdout, stderr string
	code           int
}

// agentplane runs the built binary with args, AGENTPLANE_ADDR pointing at
// the suite, and returns its output and exit code.
func agentplane(t *testing.T, args ...string) cliResult {
	t.Helper()
	return agentplaneEnv(t, nil, args...)
}

// agentplaneEnv is agentplane with extra environment variables.
func agentplaneEnv(t *testing.T, env []string, args ...string) cliResult {
	t.Helper()
	bin, addr := suiteForCLI(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = cliEnv(addr, env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("agentplane %v: %v", args, err)
	}
	r := cliResult{stdout: stdout.String(), stderr: stderr.String(), code: cmd.ProcessState.ExitCode()}
	t.Logf("agentplane %s → exit %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	return r
}

// cliEnv is the environment of the binary: the suite's address and org.
func cliEnv(addr string, extra ...string) []string {
	return append(append(os.Environ(), "AGENTPLANE_ADDR="+addr, "AGENTPLANE_ORG="+cliSuite.org), extra...)
}

func sessionsClient(t *testing.T) sessionv1.SessionServiceClient {
	_, addr := suiteForCLI(t)
	conn := devConn(t, addr, addr)
	t.Cleanup(func() { _ = conn.Close() })
	return sessionv1.NewSessionServiceClient(conn)
}

var headerRE = regexp.MustCompile(`session (ses-[0-9a-f]+) · `)

func cliRunHelloPrintsTheReply(t *testing.T) {
	r := agentplane(t, "run", "--dir", t.TempDir(), "hello")
	require.Equal(t, 0, r.code)
	require.Regexp(t, headerRE, r.stdout)
	require.Contains(t, r.stdout, "Scripted reply to: hello\n", "the streamed reply, then its newline")
	require.Contains(t, r.stdout, "→ list_files . · done\n", "a tool call on one line: name, input, status")
	require.Contains(t, r.stdout, "→ provider provider/v1/chat/completions · done (HTTP 200)\n", "the provider call answered by dev's fake model")
	require.NotContains(t, r.stdout, "←", "a call and its result are one line")
	require.Regexp(t, `(?m)^preparing: [a-z_]+ — .+ \(\d+\.\ds\)$`, r.stdout, "preparation steps with the elapsed time")
	require.Regexp(t, `(?m)^✓ succeeded — answered \d+ characters · \d+ in / \d+ out tokens, 1 request, \$\d+\.\d{6} \(\d+\.\ds\)$`, r.stdout,
		"the outcome, its summary and the turn's provider usage")
	require.NotContains(t, r.stdout, "\x1b", "no escape codes when stdout is not a terminal")
	require.Empty(t, r.stderr)
}

func cliRunFailedTurnExits1WithTheReason(t *testing.T) {
	r := agentplane(t, "run", "--dir", t.TempDir(), "fail: the tests are red")
	require.Equal(t, 1, r.code)
	require.Regexp(t, `(?m)^✗ failed: tool_error — the scripted tool failed`, r.stdout)
}

// --output json: one protojson SessionEvent per line, exactly the events
// WatchSession streams for the session from its start, up to the outcome.
func cliRunJSONLinesMatchWatchSession(t *testing.T) {
	r := agentplane(t, "run", "--output", "json", "--dir", t.TempDir(), "hello json")
	require.Equal(t, 0, r.code)
	var events []*sessionv1.SessionEvent
	sessionID := ""
	for line := range strings.Lines(r.stdout) {
		ev := &sessionv1.SessionEvent{}
		require.NoError(t, protojson.Unmarshal([]byte(line), ev), "line %q", line)
		events = append(events, ev)
		if m := ev.GetMessage(); m != nil && sessionID == "" {
			sessionID = m.GetSessionId()
		}
	}
	require.NotEmpty(t, sessionID)
	last := events[len(events)-1].GetOutcome()
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, last.GetResult(), "the last line is the outcome")

	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	stream, err := sessionsClient(t).WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sessionID})
	require.NoError(t, err)
	for i, ev := range events {
		resp, err := stream.Recv()
		require.NoError(t, err)
		require.True(t, proto.Equal(resp.GetEvent(), ev), "line %d differs from WatchSession:\n%v\n%v", i, ev, resp.GetEvent())
	}
}

// Ctrl-C while the runtime works on a slow turn: the CLI stops the session,
// its message ends cancelled, and the CLI exits 130.
func cliRunInterruptCancelsTheMessage(t *testing.T) {
	bin, addr := suiteForCLI(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "run", "--addr", addr, "--dir", t.TempDir(), "slow: take your time")
	cmd.Env = cliEnv(addr, "AGENTPLANE_ADDR=127.0.0.1:1") // --addr wins over the environment
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	var out strings.Builder
	sessionID, signalled := "", false
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		out.WriteString(sc.Text() + "\n")
		if m := headerRE.FindStringSubmatch(sc.Text()); m != nil {
			sessionID = m[1]
		}
		if strings.HasPrefix(sc.Text(), "→ list_files") && !signalled { // the turn waits for an abort now
			require.NoError(t, cmd.Process.Signal(os.Interrupt))
			signalled = true
		}
	}
	err = cmd.Wait()
	t.Logf("stdout:\n%s\nstderr:\n%s", out.String(), stderr.String())
	require.True(t, signalled, "the turn started")
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 130, exit.ExitCode())
	require.NotEmpty(t, sessionID)

	msgs, err := sessionsClient(t).ListMessages(ctx, &sessionv1.ListMessagesRequest{SessionId: sessionID})
	require.NoError(t, err)
	require.Len(t, msgs.GetMessages(), 1)
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_CANCELLED, msgs.GetMessages()[0].GetState())
}

// On a terminal the preparation steps are one line rewritten in place
// with the elapsed time.
func cliRunShowsAProgressLineOnATerminal(t *testing.T) {
	bin, addr := suiteForCLI(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "run", "--dir", t.TempDir(), "hello terminal")
	cmd.Env = cliEnv(addr, "TERM=xterm-256color")
	f, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 40, Cols: 120})
	require.NoError(t, err)
	var out bytes.Buffer
	_, _ = io.Copy(&out, f) // ends with EIO once the child has exited
	require.NoError(t, cmd.Wait())
	_ = f.Close()
	got := out.String()
	t.Logf("terminal output: %q", got)
	require.Contains(t, got, "\r"+ansi.EraseEntireLine, "the progress line is rewritten in place")
	require.Regexp(t, `\r\x1b\[2K\S+ preparing: [a-z_]+.*\(\d+\.\ds\)`, got, "a progress line with a step and the elapsed time")
	require.Contains(t, ansi.Strip(got), "Scripted reply to: hello terminal")
	require.Contains(t, ansi.Strip(got), "✓ succeeded")
}

// Bad input: one clear line on stderr, exit 2, no stack trace.
func cliBadInputIsOneLineAndExit2(t *testing.T) {
	closed := freeAddrForCLI(t)
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unknown session", []string{"session", "get", "ses-nope"}, `session not found .*\[SESSION_NOT_FOUND\]`},
		{"unknown session to watch", []string{"session", "watch", "ses-nope"}, `\[SESSION_NOT_FOUND\]`},
		{"unknown session to send to", []string{"session", "send", "ses-nope", "hi"}, `\[SESSION_NOT_FOUND\]`},
		{"unreachable address", []string{"session", "get", "--addr", closed, "ses-1"}, `cannot reach the session service at ` + regexp.QuoteMeta(closed) + `.*connection refused`},
		{"unreachable address for run", []string{"run", "--addr", closed, "hi"}, `cannot reach the session service`},
		{"bad flag", []string{"run", "--bogus", "hi"}, `flag provided but not defined: -bogus`},
		{"bad output", []string{"session", "list", "--output", "yaml"}, `--output "yaml": want human or json`},
		{"missing prompt", []string{"run"}, `want 1 argument\(s\), got 0`},
		{"empty message", []string{"session", "send", "ses-nope", ""}, `content: .*\[INVALID_REQUEST\]`},
		{"git token file without a repository", []string{"session", "create", "--git-token-file", "/nonexistent"}, `--git-token-file needs --repo`},
		// The server's message names the field and why: said once, and the URL's token never.
		{"repository URL with a token", []string{"session", "create", "--repo", "https://x:ghs_in_the_url@example.com/o/r.git"},
			`invalid worktree\.repo_url: an http\(s\) repository URL without credentials, query or fragment \[INVALID_REQUEST\]\n$`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := agentplane(t, tc.args...)
			require.Equal(t, 2, r.code)
			require.Equal(t, 1, strings.Count(r.stderr, "\n"), "one line: %q", r.stderr)
			require.Regexp(t, `^agentplane (run|session \w+): .*`+tc.want, r.stderr)
			require.NotContains(t, r.stderr, "goroutine")
			require.NotContains(t, r.stderr, "panic")
			require.NotContains(t, r.stderr, "ghs_")
			require.Empty(t, r.stdout)
		})
	}
}

func freeAddrForCLI(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// The session verbs, one after the other on one session.
func cliSessionVerbs(t *testing.T) {
	dir := t.TempDir()
	// A repo_url is always cloned (issue 32): a public repository, anonymously.
	g := gittest.Start(t, "ghs_cli_unused")
	g.CreateRepo(t, "org/r.git", map[string]string{"README.md": "hi\n"})
	g.MakePublic("org/r.git")
	repo := g.RepoURL("org/r.git")
	r := agentplane(t, "session", "create", "--dir", dir, "--repo", repo, "--output", "json")
	require.Equal(t, 0, r.code)
	s := &sessionv1.Session{}
	require.NoError(t, protojson.Unmarshal([]byte(r.stdout), s))
	id := s.GetSessionId()
	require.Equal(t, repo, s.GetWorktree().GetRepoUrl(), "--repo sets worktree.repo_url")
	require.Equal(t, dir, s.GetWorktree().GetDirectory())

	r = agentplane(t, "session", "get", id)
	require.Equal(t, 0, r.code)
	require.Regexp(t, `(?m)^session\s+`+id+`$`, r.stdout)
	require.Regexp(t, `(?m)^state\s+active$`, r.stdout)

	r = agentplane(t, "session", "send", id, "hello verbs", "--message-id", "m-verbs")
	require.Equal(t, 0, r.code)
	require.Contains(t, r.stdout, "message m-verbs queued")

	// watch follows until Ctrl-C; it shows the turn of the message sent.
	bin, addr := suiteForCLI(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	w := exec.CommandContext(ctx, bin, "session", "watch", "--output", "json", id)
	w.Env = cliEnv(addr)
	stdout, err := w.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, w.Start())
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		ev := &sessionv1.SessionEvent{}
		require.NoError(t, protojson.Unmarshal(sc.Bytes(), ev))
		if ev.GetOutcome().GetLastMessageId() == "m-verbs" {
			require.NoError(t, w.Process.Signal(os.Interrupt))
		}
	}
	var exit *exec.ExitError
	require.ErrorAs(t, w.Wait(), &exit)
	require.Equal(t, 130, exit.ExitCode())

	r = agentplane(t, "session", "list")
	require.Equal(t, 0, r.code)
	require.Regexp(t, `(?m)^SESSION\s+STATE\s+ROUTE`, r.stdout)
	require.Regexp(t, `(?m)^`+id+`\s+active\s+ready`, r.stdout, "--org from AGENTPLANE_ORG")

	r = agentplane(t, "session", "stop", id)
	require.Equal(t, 0, r.code)
	require.Regexp(t, `(?m)^state\s+stopped$`, r.stdout)

	// export prints the session's whole history (ExportHistory, issue 32).
	r = agentplane(t, "session", "export", id)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `(?m)^RUNTIME SESSION\s+ITEM\s+TYPE`, r.stdout)
	require.Regexp(t, `(?m)^rs_\S+\s+\S+\s+\w+\s+\d+`, r.stdout, "at least one item of the turn")

	r = agentplane(t, "session", "delete", id)
	require.Equal(t, 0, r.code, "delete waits through any pending cleanup")
	require.Equal(t, "deleted "+id+"\n", r.stdout)

	r = agentplane(t, "session", "get", id)
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "[SESSION_NOT_FOUND]")
}

// --timeout gives up following a turn that does not end: exit 1, one line
// naming the session whose turn goes on.
func cliRunTimeoutGivesUp(t *testing.T) {
	r := agentplane(t, "run", "--timeout", "2s", "--dir", t.TempDir(), "slow: longer than the timeout")
	require.Equal(t, 1, r.code)
	require.Regexp(t, `^agentplane run: no outcome within --timeout 2s; the turn goes on in session ses-[0-9a-f]+\n$`, r.stderr)
}

// --agent sets agent.profile; an agent that is not installed is refused
// once ("agent unavailable" said once) with the hint to run `make agents`.
func cliAgentFlag(t *testing.T) {
	r := agentplane(t, "session", "create", "--dir", t.TempDir(), "--agent", "scripted", "--output", "json")
	require.Equal(t, 0, r.code)
	s := &sessionv1.Session{}
	require.NoError(t, protojson.Unmarshal([]byte(r.stdout), s))
	require.Equal(t, "scripted", s.GetAgent().GetProfile())

	r = agentplane(t, "run", "--dir", t.TempDir(), "--agent", "opencode", "hi")
	require.Equal(t, 2, r.code)
	require.Equal(t, 1, strings.Count(r.stderr, "agent unavailable"), "said once: %q", r.stderr)
	require.Contains(t, r.stderr, "`make agents`")
	require.Contains(t, r.stderr, "[AGENT_UNAVAILABLE]")
}

// --timeout shorter than the first call: the service was reachable, so the
// message says the deadline passed, not that the service cannot be reached.
func cliRunTimeoutBeforeTheSessionIsCreated(t *testing.T) {
	r := agentplane(t, "run", "--timeout", "1ms", "--dir", t.TempDir(), "hi")
	require.Equal(t, 1, r.code)
	require.Equal(t, "agentplane run: --timeout 1ms passed before the session was created\n", r.stderr)
}

// --git-token-file and AGENTPLANE_GIT_TOKEN give --repo its token: the
// worktree is cloned (the runtime lists the repository's files) and the
// token is printed nowhere.
func cliGitTokenClonesTheRepository(t *testing.T) {
	token := fmt.Sprintf("ghs_cli_%d", time.Now().UnixNano())
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/cli.git", map[string]string{"README.md": "hello\n", "CLONED_FROM_GIT": "x\n"})
	tokenFile := filepath.Join(t.TempDir(), "git-token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(token+"\n"), 0o600))

	for _, tc := range []struct {
		name string
		args []string
		env  []string
	}{
		{"file", []string{"--git-token-file", tokenFile}, nil},
		{"environment", nil, []string{"AGENTPLANE_GIT_TOKEN=" + token}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"run", "--repo", g.RepoURL("org/cli.git"), "--dir", "/work/cli-git-" + tc.name + "-" + cliSuite.org, "--output", "json", "hello repo"}, tc.args...)
			r := agentplaneEnv(t, tc.env, args...)
			require.Equal(t, 0, r.code)
			require.Contains(t, r.stdout, "CLONED_FROM_GIT", "the runtime lists the cloned files (tool output is in the JSON events)")
			require.NotContains(t, r.stdout+r.stderr, token)
		})
	}
	// Without a token nothing is cloned (the old CLI's case), and run says why its turn failed:
	// the route's reason, which comes after the failed message, with what to do about it.
	r := agentplane(t, "run", "--repo", g.RepoURL("org/cli.git"), "--dir", "/work/cli-git-none-"+cliSuite.org, "--output", "json", "hello repo")
	require.NotContains(t, r.stdout, "CLONED_FROM_GIT")
	r = agentplane(t, "run", "--repo", g.RepoURL("org/cli.git"), "--dir", "/work/cli-git-none2-"+cliSuite.org, "hello repo")
	require.Equal(t, 1, r.code)
	require.Regexp(t, `(?m)^✗ message \S+ failed: route_failed$`, r.stdout)
	require.Equal(t, 1, strings.Count(r.stdout, "✗ preparation failed: repo_auth_failed (the git token was refused, or the repository wants one: --git-token-file or AGENTPLANE_GIT_TOKEN)\n"),
		"the route's reason, once")

	// A token in the environment is for sessions with a repository: one without is created.
	r = agentplaneEnv(t, []string{"AGENTPLANE_GIT_TOKEN=" + token}, "session", "create", "--dir", "/work/cli-git-norepo-"+cliSuite.org)
	require.Equal(t, 0, r.code, r.stderr)
	require.NotContains(t, r.stdout+r.stderr, token)
}

// session changes, push and egress on one session with a repository.
func cliChangesPushEgress(t *testing.T) {
	token := fmt.Sprintf("ghs_cli_%d", time.Now().UnixNano())
	g := gittest.Start(t, token)
	bare := g.CreateRepo(t, "org/push.git", map[string]string{"README.md": "hello\n"})
	r := agentplaneEnv(t, []string{"AGENTPLANE_GIT_TOKEN=" + token}, "session", "create", "--output", "json",
		"--repo", g.RepoURL("org/push.git"), "--dir", "/work/cli-push-"+cliSuite.org)
	require.Equal(t, 0, r.code)
	s := &sessionv1.Session{}
	require.NoError(t, protojson.Unmarshal([]byte(r.stdout), s))
	id := s.GetSessionId()
	r = agentplane(t, "session", "send", id, "write: NOTES.md notes from the cli", "--message-id", "m-notes")
	require.Equal(t, 0, r.code)

	require.Eventually(t, func() bool {
		r = agentplane(t, "session", "changes", id)
		return r.code == 0 && strings.Contains(r.stdout, "NOTES.md")
	}, time.Minute, 500*time.Millisecond, "the change appears")
	require.Regexp(t, `(?m)^added\s+NOTES\.md$`, r.stdout)
	require.Contains(t, r.stdout, "+notes from the cli", "the diff")

	r = agentplane(t, "session", "push", id, "--branch", "agent/cli", "--author-email", "cli at example.com")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "author_email")
	r = agentplane(t, "session", "push", id, "--branch", "agent/cli", "--message", "notes from the CLI",
		"--author-name", "CLI User", "--author-email", "cli@example.com")
	require.Equal(t, 0, r.code)
	require.Regexp(t, `^committed and pushed [0-9a-f]{12} to refs/heads/agent/cli\n$`, r.stdout)
	require.Equal(t, "notes from the CLI\nCLI User <cli@example.com>\n", gittest.Run(t, bare, "log", "-1", "--format=%s%n%an <%ae>", "agent/cli"))

	r = agentplane(t, "session", "egress", id, "--allow", "registry.npmjs.org,example.com:8080|8443")
	require.Equal(t, 0, r.code)
	require.Regexp(t, `^egress policy version \d+: registry\.npmjs\.org,example\.com:8080\|8443\n$`, r.stdout)
	got, err := sessionsClient(t).GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: id})
	require.NoError(t, err)
	require.Len(t, got.GetSession().GetEgress().GetAllow(), 2, "the policy is stored")
	// Without --allow, egress shows the policy in force and changes nothing (it used to replace
	// it with an empty one).
	r = agentplane(t, "session", "egress", id)
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, fmt.Sprintf("egress policy version %d: registry.npmjs.org,example.com:8080|8443\n", got.GetSession().GetEgressVersion()), r.stdout)
	again, err := sessionsClient(t).GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: id})
	require.NoError(t, err)
	require.True(t, proto.Equal(got.GetSession().GetEgress(), again.GetSession().GetEgress()), "unchanged")
	require.Equal(t, got.GetSession().GetEgressVersion(), again.GetSession().GetEgressVersion())
	r = agentplane(t, "session", "egress", id, "--expected-version", "1")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "--expected-version needs --allow")

	r = agentplane(t, "session", "egress", id, "--allow", "*")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "--allow")
	r = agentplane(t, "session", "changes", "ses-nope")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "[SESSION_NOT_FOUND]")
}

// cliGitPushPrefix: session create --git-push-prefix confines the
// session's pushes to that namespace (shown as "pushes team/cli/*"):
// session push to team/cli/x lands, to agent/x the git route refuses; a
// prefix the route could not enforce is a usage error naming the field.
func cliGitPushPrefix(t *testing.T) {
	token := fmt.Sprintf("ghs_cli_prefix_%d", time.Now().UnixNano())
	g := gittest.Start(t, token)
	bare := g.CreateRepo(t, "org/prefix.git", map[string]string{"README.md": "hello\n"})
	env := []string{"AGENTPLANE_GIT_TOKEN=" + token}
	r := agentplaneEnv(t, env, "session", "create", "--repo", g.RepoURL("org/prefix.git"),
		"--dir", "/work/cli-prefix-"+cliSuite.org, "--git-push-prefix", "main")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "git_credential.push_branch_prefix")
	require.NotContains(t, r.stderr, token)

	r = agentplaneEnv(t, env, "session", "create", "--repo", g.RepoURL("org/prefix.git"),
		"--dir", "/work/cli-prefix-"+cliSuite.org, "--git-push-prefix", "team/cli/")
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `(?m)^pushes\s+team/cli/\*$`, r.stdout)
	id := regexp.MustCompile(`(?m)^session\s+(\S+)$`).FindStringSubmatch(r.stdout)[1]
	r = agentplane(t, "session", "send", id, "write: NOTES.md notes from the cli", "--message-id", "m-notes")
	require.Equal(t, 0, r.code)
	require.Eventually(t, func() bool {
		r = agentplane(t, "session", "changes", id)
		return r.code == 0 && strings.Contains(r.stdout, "NOTES.md")
	}, time.Minute, 500*time.Millisecond, "the change appears")

	r = agentplane(t, "session", "push", id, "--branch", "team/cli/x", "--message", "notes")
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `^committed and pushed [0-9a-f]{12} to refs/heads/team/cli/x\n$`, r.stdout)
	refs := gittest.Run(t, bare, "show-ref")
	r = agentplane(t, "session", "push", id, "--branch", "agent/cli")
	require.NotEqual(t, 0, r.code)
	require.Contains(t, r.stderr, "PUSH_REJECTED")
	require.Equal(t, refs, gittest.Run(t, bare, "show-ref"), "the remote is unchanged")
}

// session files and cat list and print the worktree's files; a path out of
// it is a usage error with the field, a symlink out of it the wrapper's
// reason.
func cliFilesCat(t *testing.T) {
	dir := "/work/cli-files-" + cliSuite.org
	r := agentplane(t, "session", "create", "--output", "json", "--dir", dir)
	require.Equal(t, 0, r.code, r.stderr)
	s := &sessionv1.Session{}
	require.NoError(t, protojson.Unmarshal([]byte(r.stdout), s))
	id := s.GetSessionId()
	r = agentplane(t, "session", "send", id, "write: docs/guide.md read me", "--message-id", "m-write")
	require.Equal(t, 0, r.code, r.stderr)
	r = agentplane(t, "session", "send", id, "run: ln -s /etc/hostname host", "--message-id", "m-link")
	require.Equal(t, 0, r.code, r.stderr)

	require.Eventually(t, func() bool {
		r = agentplane(t, "session", "files", id)
		return r.code == 0 && strings.Contains(r.stdout, "host")
	}, time.Minute, 500*time.Millisecond, "the symlink appears")
	require.Regexp(t, `(?m)^directory\s+0755\s+\d+\s+docs/$`, r.stdout)
	require.Regexp(t, `(?m)^symlink\s+0777\s+13\s+host$`, r.stdout)
	r = agentplane(t, "session", "files", id, "docs")
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `^file\s+0644\s+8\s+guide\.md\n$`, r.stdout)
	r = agentplane(t, "session", "cat", id, "docs/guide.md")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "read me\n", r.stdout)

	r = agentplane(t, "session", "cat", id, "../etc/hostname")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "path")
	r = agentplane(t, "session", "cat", id, "host")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "[PATH_ESCAPES_WORKTREE]")
	r = agentplane(t, "session", "files", id, "docs", "extra")
	require.Equal(t, 2, r.code)

	local := filepath.Join(t.TempDir(), "put.sh")
	require.NoError(t, os.WriteFile(local, []byte("echo put\n"), 0o600))
	r = agentplane(t, "session", "put", id, "bin/put.sh", local, "--mode", "0750")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "wrote 9 bytes to bin/put.sh\n", r.stdout)
	r = agentplane(t, "session", "files", id, "bin")
	require.Regexp(t, `^file\s+0750\s+9\s+put\.sh\n$`, r.stdout)
	r = agentplane(t, "session", "cat", id, "bin/put.sh")
	require.Equal(t, "echo put\n", r.stdout)
	r = agentplane(t, "session", "put", id, "host", local)
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "[PATH_ESCAPES_WORKTREE]")
	r = agentplane(t, "session", "put", id, "x", local, "--mode", "9")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "--mode")
}

// cliUsage (issue 36): session usage shows the session's provider tokens,
// requests, model and cost (GetSession's usage), as lines or as JSON; get
// shows them on one line; a session without provider calls has none.
func cliUsage(t *testing.T) {
	dir := "/work/cli-usage-" + cliSuite.org
	r := agentplane(t, "run", "--dir", dir, "--output", "json", "hello usage")
	require.Equal(t, 0, r.code, r.stderr)
	var turn *runtimev1.TokenUsage
	var id string
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		ev := &sessionv1.SessionEvent{}
		require.NoError(t, protojson.Unmarshal([]byte(line), ev))
		if m := ev.GetMessage(); m != nil {
			id = m.GetSessionId()
		}
		if o := ev.GetOutcome(); o != nil {
			turn = o.GetUsage()
		}
	}
	require.NotZero(t, turn.GetInputTokens(), "the fake model's usage reaches the outcome")
	require.NotEmpty(t, id)

	r = agentplane(t, "session", "usage", id)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, fmt.Sprintf(`^input tokens\s+%d\ncached tokens\s+%d\noutput tokens\s+%d\nrequests\s+1\nmodel\s+%s\ncost\s+\$\d+\.\d{6}\n$`,
		turn.GetInputTokens(), turn.GetCachedTokens(), turn.GetOutputTokens(), regexp.QuoteMeta(turn.GetModel())), r.stdout)
	r = agentplane(t, "session", "usage", "--output", "json", id)
	require.Equal(t, 0, r.code, r.stderr)
	total := &runtimev1.TokenUsage{}
	require.NoError(t, protojson.Unmarshal([]byte(r.stdout), total))
	require.True(t, proto.Equal(turn, total), "one turn: the totals are the turn's\nturn %v\ntotal %v", turn, total)
	want := (float64(turn.GetInputTokens())*1 + float64(turn.GetOutputTokens())*2) / 1e6
	require.InDelta(t, want, total.GetCostUsd(), 1e-9, "priced by the suite's table")
	r = agentplane(t, "session", "get", id)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, fmt.Sprintf(`(?m)^usage\s+%d in / %d out tokens, 1 request, \$\d+\.\d{6}$`, turn.GetInputTokens(), turn.GetOutputTokens()), r.stdout)

	r = agentplane(t, "session", "create", "--dir", dir+"-none")
	require.Equal(t, 0, r.code, r.stderr)
	require.NotRegexp(t, `(?m)^usage\s`, r.stdout, "no provider calls, no usage line")
	other := regexp.MustCompile(`(?m)^session\s+(\S+)$`).FindStringSubmatch(r.stdout)[1]
	r = agentplane(t, "session", "usage", other)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `(?m)^requests\s+0$`, r.stdout)
	require.Regexp(t, `(?m)^cost\s+-$`, r.stdout)
	r = agentplane(t, "session", "usage", "ses-nope")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "[SESSION_NOT_FOUND]")
}

// cliAudit (issue 36 item 2): session audit lists the session's audit
// records with their turn, as lines or one AuditRecord per JSON line;
// --turn lists one turn's; an unknown session is exit 2 with its reason.
func cliAudit(t *testing.T) {
	dir := "/work/cli-audit-" + cliSuite.org
	r := agentplane(t, "run", "--dir", dir, "--output", "json", "hello audit")
	require.Equal(t, 0, r.code, r.stderr)
	var id, turn string
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		ev := &sessionv1.SessionEvent{}
		require.NoError(t, protojson.Unmarshal([]byte(line), ev))
		if m := ev.GetMessage(); m != nil {
			id, turn = m.GetSessionId(), m.GetMessageId()
		}
	}
	require.NotEmpty(t, id)
	// The proxy reports in batches: the record comes shortly after the turn.
	require.Eventually(t, func() bool {
		r = agentplane(t, "session", "audit", id)
		return r.code == 0 && strings.Contains(r.stdout, "provider")
	}, 30*time.Second, 100*time.Millisecond, "stdout %q stderr %q", r.stdout, r.stderr)
	require.Regexp(t, `^TIME\s+TURN\s+KIND\s+WHAT\s+RESULT\n`, r.stdout)
	require.Regexp(t, `(?m)^\d\d:\d\d:\d\d\.\d{3}\s+`+regexp.QuoteMeta(turn)+`\s+provider\s+POST v1/chat/completions\s+200 \(`, r.stdout)
	r = agentplane(t, "session", "audit", "--output", "json", "--turn", turn, id)
	require.Equal(t, 0, r.code, r.stderr)
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		rec := &sessionv1.AuditRecord{}
		require.NoError(t, protojson.Unmarshal([]byte(line), rec))
		require.Equal(t, turn, rec.GetTurnId())
		require.Equal(t, id, rec.GetSessionId())
	}
	r = agentplane(t, "session", "audit", "ses-nope")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "[SESSION_NOT_FOUND]")
}
