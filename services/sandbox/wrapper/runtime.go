package wrapper

import (
	"errors"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"agentplane.dev/services/sandbox/internal/provider"
	"agentplane.dev/services/sandbox/internal/runtimeproto"
)

// EnvRuntimeParent names, in a runtime's environment, the wrapper instance
// supervising it. The runtime never inherits the wrapper's markers: discovery
// must see exactly one marked process (the wrapper) per runtime key.
const EnvRuntimeParent = "AGENTPLANE_RUNTIME_PARENT"

// runtimeProc is the one runtime process of the wrapper, in its own process
// group, spoken to in JSON lines on its stdio.
type runtimeProc struct {
	cmd    *exec.Cmd
	in     *runtimeproto.Writer
	stdin  io.Closer
	exited chan struct{}
	once   sync.Once
}

// startRuntime starts argv in a new process group; frames it prints go to
// onFrame, and onExit runs once it exits.
func startRuntime(argv []string, instance string, onFrame func(runtimeproto.Frame), onExit func()) (*runtimeProc, error) {
	if len(argv) == 0 {
		return nil, errors.New("no runtime command")
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = runtimeEnv(os.Environ(), instance)
	cmd.Stderr = os.Stderr
	// Own process group so stopping the runtime reaches its children too;
	// Pdeathsig kills it if the wrapper dies without cleaning up (kill -9).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
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
	p := &runtimeProc{cmd: cmd, in: runtimeproto.NewWriter(stdin), stdin: stdin, exited: make(chan struct{})}
	go func() {
		sc := runtimeproto.NewScanner(stdout)
		for sc.Scan() {
			f, err := runtimeproto.Parse(sc.Bytes())
			if err != nil {
				continue // a runtime's garbage is not the control plane's problem
			}
			onFrame(f)
		}
		_ = cmd.Wait()
		close(p.exited)
		onExit()
	}()
	return p, nil
}

func runtimeEnv(env []string, instance string) []string {
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

func (p *runtimeProc) send(f runtimeproto.Frame) error { return p.in.Write(f) }

// stop asks the runtime to shut down, then terminates and kills its process
// group; it returns once the runtime has exited.
func (p *runtimeProc) stop() {
	p.once.Do(func() {
		_ = p.in.Write(runtimeproto.Frame{Type: runtimeproto.TypeShutdown})
		_ = p.stdin.Close()
		pgid := p.cmd.Process.Pid
		select {
		case <-p.exited:
		case <-time.After(2 * time.Second):
			_ = syscall.Kill(-pgid, syscall.SIGTERM)
			select {
			case <-p.exited:
			case <-time.After(time.Second):
			}
		}
		// Whatever is left of the group (grandchildren) goes too.
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-p.exited
	})
}
