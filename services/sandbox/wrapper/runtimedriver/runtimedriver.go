// Package runtimedriver is the seam between the wrapper and its one agent
// runtime process. The wrapper speaks the frames of internal/agent/runtimejsonl
// (open_route, message, abort, credentials, close_route, shutdown one way;
// route_ready, route_failed, progress, event, outcome the other), whatever
// the process itself speaks: the jsonl driver passes them through as
// agentplane's JSON lines (the scripted runtime), the acp driver translates
// them to and from the Agent Client Protocol (opencode, Kilo, any ACP agent).
package runtimedriver

import (
	"context"
	"os"
	"os/exec"
	"strings"

	"agentplane.dev/services/sandbox/internal/agent/command"
	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
	"agentplane.dev/services/sandbox/internal/node/boundary"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// EnvRuntimeParent names, in a runtime's environment, the wrapper instance
// supervising it. The runtime never inherits the wrapper's markers: discovery
// must see exactly one marked process (the wrapper) per runtime key.
const EnvRuntimeParent = "AGENTPLANE_RUNTIME_PARENT"

// Runtime is the wrapper's running agent runtime.
type Runtime interface {
	// Send hands the runtime one wrapper → runtime frame.
	Send(f runtimejsonl.Frame) error
	// Stop ends the runtime and every process of its group; it returns once
	// the runtime has exited.
	Stop()
}

// Hooks are how a runtime reports back: OnFrame for each runtime → wrapper
// frame (called from one goroutine at a time per runtime), OnExit once after
// the process exited.
type Hooks struct {
	OnFrame func(runtimejsonl.Frame)
	OnExit  func()
}

// Starter starts a runtime for a wrapper instance.
type Starter func(instance string, h Hooks) (Runtime, error)

// Nest puts the runtime, and everything it starts, in the agent's nested
// sandbox (boundary.NestedArgs) inside the wrapper's: the runtime then
// cannot see, signal, trace or read the wrapper, which holds the launch
// credential and the handles (DESIGN.md 3.3).
type Nest struct {
	// Bwrap is bubblewrap as the wrapper's sandbox sees it.
	Bwrap string
}

// Process is a runtime process to start with Start, which also closes the
// descriptors only its nested bubblewrap reads.
type Process struct {
	*exec.Cmd
	files []*os.File
}

// Start starts the process and closes the parent's copies of its files.
func (p *Process) Start() error {
	err := p.Cmd.Start()
	for _, f := range p.files {
		_ = f.Close()
	}
	return err
}

// Command builds the runtime process: its own process group (stopping it
// reaches its children) and Pdeathsig (a wrapper killed with -9 takes it
// along), the wrapper's environment without the markers plus extra, in the
// working directory; with nest, run by bubblewrap in the nested sandbox
// (stopping or killing bubblewrap's group ends every process in it).
func Command(argv []string, instance string, extra []string, nest *Nest) (*Process, error) {
	spec := command.Spec{Path: argv[0], Args: argv[1:], Env: append(Env(os.Environ(), instance), extra...), Group: true, Stderr: os.Stderr}
	var files []*os.File
	if nest != nil {
		sc, err := boundary.SeccompFile()
		if err != nil {
			return nil, err
		}
		dir, err := os.Getwd()
		if err != nil {
			_ = sc.Close()
			return nil, err
		}
		spec.Path, spec.Args = nest.Bwrap, append(boundary.NestedArgs(3, dir), argv...)
		files = []*os.File{sc}
		spec.ExtraFiles = files
	}
	return &Process{Cmd: command.New(context.Background(), spec), files: files}, nil
}

// Env is env without the wrapper's discovery markers, naming the wrapper
// instance as the runtime's parent.
func Env(env []string, instance string) []string {
	out := make([]string, 0, len(env)+1)
	for _, kv := range env {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case provider.EnvSandbox, provider.EnvRuntimeKey, provider.EnvInstance, provider.EnvGeneration:
			continue
		}
		out = append(out, kv)
	}
	return append(out, EnvRuntimeParent+"="+instance)
}
