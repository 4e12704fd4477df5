package worktree

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"

	"agentplane.dev/services/sandbox/internal/agent/command"
)

// gitEnv is the whole environment of every git command: no inherited
// variable, no secret, no prompt, no system or user configuration or
// attributes.
func gitEnv(extra ...string) []string {
	env := []string{
		"PATH=" + os.Getenv("PATH"), "HOME=/nonexistent", "LC_ALL=C",
		"GIT_TERMINAL_PROMPT=0", "GIT_ASKPASS=", "SSH_ASKPASS=", "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null",
		"GIT_ATTR_NOSYSTEM=1",
	}
	return append(env, extra...)
}

// git runs git in dir and returns its stdout; stderr goes to the error
// text (and to errOut when given).
func git(ctx context.Context, dir string, stdin io.Reader, args ...string) (string, string, error) {
	return gitWith(ctx, dir, nil, stdin, args...)
}

// gitWith is git with extra environment variables.
func gitWith(ctx context.Context, dir string, env []string, stdin io.Reader, args ...string) (string, string, error) {
	cmd := gitCmd(ctx, dir, gitEnv(env...), args...)
	cmd.Stdin = stdin
	var out bytes.Buffer
	cmd.Stdout = &out
	err := cmd.Run()
	return out.String(), command.Stderr(cmd), err
}

// gitCmd is a git command that dies with the wrapper (kill -9 included):
// a clone must not outlive the process that would mark it complete. Its
// options come from safeArgs; its stderr is kept as a bounded tail.
func gitCmd(ctx context.Context, dir string, env []string, args ...string) *exec.Cmd {
	return command.New(ctx, command.Spec{Path: "git", Args: safeArgs(ctx, dir, args), Dir: dir, Env: env})
}

// safeConfig goes on the command line of every git command the wrapper
// runs, where it overrides the repository's own config, which the agent
// can write (docs/worktrees.md, "Git runs with a config the agent cannot
// influence"): no fsmonitor, hooks, untracked cache, global attributes,
// credential helper, askpass program, external diff, submodule recursion
// or ssh command, and only the http(s) transports (the relay's).
var safeConfig = []string{
	"-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "core.untrackedCache=false",
	"-c", "core.attributesFile=/dev/null", "-c", "core.askPass=", "-c", "credential.helper=",
	"-c", "diff.external=", "-c", "core.sshCommand=", "-c", "submodule.recurse=false", "-c", "push.recurseSubmodules=no",
	"-c", "protocol.allow=never", "-c", "protocol.http.allow=always", "-c", "protocol.https.allow=always",
}

// safeArgs is args behind the safe options: safeConfig, every filter
// driver the repository's config defines switched off (a .gitattributes
// the agent writes can name any driver, so they are read from the config
// just before the command), and for diff no external diff or textconv.
func safeArgs(ctx context.Context, dir string, args []string) []string {
	out := append(slices.Clone(safeConfig), filterOverrides(ctx, dir)...)
	if len(args) > 0 && args[0] == "diff" {
		return append(append(append(out, "diff"), "--no-ext-diff", "--no-textconv"), args[1:]...)
	}
	return append(out, args...)
}

// filterOverrides returns -c options that empty each filter driver's
// commands the config of the repository at dir defines (git runs no
// filter with an empty command) and make none required.
func filterOverrides(ctx context.Context, dir string) []string {
	if dir == "" {
		return nil
	}
	cmd := command.New(ctx, command.Spec{Path: "git", Args: append(slices.Clone(safeConfig), "config", "-z", "--get-regexp", `^filter\.`),
		Dir: dir, Env: gitEnv()})
	list, _ := cmd.Output() // exit 1: no filter
	var out []string
	for entry := range strings.SplitSeq(string(list), "\x00") {
		key, _, _ := strings.Cut(entry, "\n")
		i := strings.LastIndexByte(key, '.')
		if i < 0 {
			continue
		}
		switch key[i+1:] {
		case "clean", "smudge", "process":
			out = append(out, "-c", key+"=")
		case "required":
			out = append(out, "-c", key+"=false")
		}
	}
	return out
}

// identity is the committer of pushes (the agentplane service, not a user),
// and their author unless the push names one.
var identity = []string{"-c", "user.name=agentplane", "-c", "user.email=agentplane@localhost", "-c", "commit.gpgsign=false"}

func trim(s string) string { return strings.TrimSpace(s) }
