// Package jsonl is the runtime driver for runtimes that speak agentplane's
// own JSON lines on stdio (docs/runtime-protocol.md), such as the built-in
// scripted runtime: frames pass through unchanged.
package jsonl

import (
	"errors"
	"io"
	"sync"
	"syscall"
	"time"

	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
	"agentplane.dev/services/sandbox/wrapper/runtimedriver"
)

// runtimeProc is the one runtime process of the wrapper, in its own process
// group, spoken to in JSON lines on its stdio.
type runtimeProc struct {
	pgid   int
	in     *runtimejsonl.Writer
	stdin  io.Closer
	exited chan struct{}
	once   sync.Once
}

// Starter starts argv as a JSON-lines runtime, with extra environment
// (NAME=value, never a secret), in the nested sandbox of nest (nil: none).
func Starter(argv []string, nest *runtimedriver.Nest, extra ...string) runtimedriver.Starter {
	return func(instance string, h runtimedriver.Hooks) (runtimedriver.Runtime, error) {
		return start(argv, extra, nest, instance, h)
	}
}

func start(argv, extra []string, nest *runtimedriver.Nest, instance string, h runtimedriver.Hooks) (*runtimeProc, error) {
	if len(argv) == 0 {
		return nil, errors.New("no runtime command")
	}
	cmd, err := runtimedriver.Command(argv, instance, extra, nest)
	if err != nil {
		return nil, err
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &runtimeProc{pgid: cmd.Process.Pid, in: runtimejsonl.NewWriter(stdin), stdin: stdin, exited: make(chan struct{})}
	go func() {
		sc := runtimejsonl.NewScanner(stdout)
		for sc.Scan() {
			f, err := runtimejsonl.Parse(sc.Bytes())
			if err != nil {
				continue // a runtime's garbage is not the control plane's problem
			}
			h.OnFrame(f)
		}
		_ = cmd.Wait()
		close(p.exited)
		h.OnExit()
	}()
	return p, nil
}

func (p *runtimeProc) Send(f runtimejsonl.Frame) error { return p.in.Write(f) }

// Stop asks the runtime to shut down, then terminates and kills its process
// group; it returns once the runtime has exited.
func (p *runtimeProc) Stop() {
	p.once.Do(func() {
		_ = p.in.Write(runtimejsonl.Frame{Type: runtimejsonl.TypeShutdown})
		_ = p.stdin.Close()
		select {
		case <-p.exited:
		case <-time.After(2 * time.Second):
			_ = syscall.Kill(-p.pgid, syscall.SIGTERM)
			select {
			case <-p.exited:
			case <-time.After(time.Second):
			}
		}
		// Whatever is left of the group (grandchildren) goes too.
		_ = syscall.Kill(-p.pgid, syscall.SIGKILL)
		<-p.exited
	})
}
