package worktree

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// gitEnv is the whole environment of every git command: no inherited
// variable, no secret, no prompt, no system or user configuration.
func gitEnv(extra ...string) []string {
	env := []string{
		"PATH=" + os.Getenv("PATH"), "HOME=/nonexistent", "LC_ALL=C",
		"GIT_TERMINAL_PROMPT=0", "GIT_ASKPASS=", "SSH_ASKPASS=", "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null",
	}
	return append(env, extra...)
}

// git runs git in dir and returns its stdout; stderr goes to the error
// text (and to errOut when given).
func git(ctx context.Context, dir string, stdin io.Reader, args ...string) (string, string, error) {
	cmd := gitCmd(ctx, dir, gitEnv(), args...)
	cmd.Stdin = stdin
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

// gitCmd is a git command that dies with the wrapper (kill -9 included):
// a clone must not outlive the process that would mark it complete.
func gitCmd(ctx context.Context, dir string, env []string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// identity is the committer of pushes (the agentplane service, not a user).
var identity = []string{"-c", "user.name=agentplane", "-c", "user.email=agentplane@localhost", "-c", "commit.gpgsign=false"}

func trim(s string) string { return strings.TrimSpace(s) }
