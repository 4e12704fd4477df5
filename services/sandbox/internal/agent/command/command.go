// Package command builds every child process the sandbox service and its
// wrapper start (the wrapper, bubblewrap, the agent runtime, git), so each
// gets the same guarantees instead of one site's choice: an environment
// given in full (never the parent's by accident), death with its parent
// unless it is meant to outlive it, a bounded wait for its output once it
// has exited, and stderr kept as a bounded tail for error messages. A lint
// rule (forbidigo on exec.Command in services/sandbox) keeps it the only
// place that calls exec.Command.
package command

import (
	"context"
	"io"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// WaitDelay bounds how long Wait waits for a child's output pipes after the
// child has exited (or its context ended): a grandchild holding a pipe open
// must not hold the caller.
const WaitDelay = 5 * time.Second

// StderrTail is how much of a child's stderr is kept when the caller gives
// no writer: enough for git's or bubblewrap's message, never a flood.
const StderrTail = 64 << 10

// Spec is one child process.
type Spec struct {
	Path string
	Args []string
	Dir  string
	// Env is the whole environment; nil is an empty one.
	Env []string
	// Group puts the child in its own process group, so that stopping the
	// group reaches every process it starts.
	Group bool
	// Outlives lets the child survive this process (the sandbox service's
	// wrappers survive a restart of the service). Otherwise the kernel
	// kills it (SIGKILL) when this process dies, kill -9 included.
	Outlives   bool
	Credential *syscall.Credential
	ExtraFiles []*os.File
	Stdin      io.Reader
	Stdout     io.Writer
	// Stderr receives the child's stderr; nil keeps its last StderrTail
	// bytes, read back with Stderr.
	Stderr io.Writer
}

// New returns the command of spec; ctx ending kills it (SIGKILL).
func New(ctx context.Context, spec Spec) *exec.Cmd {
	cmd := exec.CommandContext(ctx, spec.Path, spec.Args...) //nolint:forbidigo // the one place that builds a child process
	cmd.Dir = spec.Dir
	cmd.Env = spec.Env
	if cmd.Env == nil {
		cmd.Env = []string{}
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: spec.Group, Credential: spec.Credential}
	if !spec.Outlives {
		cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	}
	cmd.ExtraFiles = spec.ExtraFiles
	cmd.Stdin, cmd.Stdout, cmd.Stderr = spec.Stdin, spec.Stdout, spec.Stderr
	if cmd.Stderr == nil {
		cmd.Stderr = &Tail{Max: StderrTail}
	}
	cmd.WaitDelay = WaitDelay
	return cmd
}

// Stderr is the kept tail of cmd's stderr when New kept it, else "".
func Stderr(cmd *exec.Cmd) string {
	if t, ok := cmd.Stderr.(*Tail); ok {
		return t.String()
	}
	return ""
}

// Tail is an io.Writer that keeps the last Max bytes written to it.
type Tail struct {
	Max int
	buf []byte
}

func (t *Tail) Write(p []byte) (int, error) {
	n := len(p)
	if len(p) >= t.Max {
		t.buf = append(t.buf[:0], p[len(p)-t.Max:]...)
		return n, nil
	}
	if over := len(t.buf) + len(p) - t.Max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	t.buf = append(t.buf, p...)
	return n, nil
}

// String is what the tail holds.
func (t *Tail) String() string { return string(t.buf) }
