// Package process is the process provider of the AgentSandbox seam
// (DESIGN.md 3.3): a sandbox is a directory tree on this node and wrappers
// are child processes in their own process groups.
//
// Layout under Config.Root:
//
//	<root>/<sandbox-id>/workspaces/<name>   working directory of a workspace's wrapper
//	<root>/<sandbox-id>/homes/<name>        its HOME
//	<root>/<sandbox-id>/logs/<name>.<instance>.log   the wrapper's stdout and stderr
//
// where <name> is WorkspaceName(route workspace directory). Discovery never
// trusts memory of what it started: it reads /proc/<pid>/environ of every
// process, so it finds wrappers of a previous incarnation of the service
// (after kill -9) as well as its own.
package process

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"agentplane.dev/pkg/pause"
	"agentplane.dev/services/sandbox/internal/provider"
)

// Config of the process provider.
type Config struct {
	// Root holds one directory per sandbox.
	Root string
	// ProcRoot is the proc filesystem (default /proc); fault tests point it
	// at a fake tree.
	ProcRoot string
	// Sleep waits between stop observations (default: a timer that ends
	// early with ctx).
	Sleep func(ctx context.Context, d time.Duration) error
	// BaseEnv is the environment every wrapper starts from (default: PATH
	// only). The service's own environment is never inherited: it holds
	// secrets, and environ is readable through /proc.
	BaseEnv []string
	Logger  *slog.Logger
}

// StopSchedule is when Stop observes after SIGTERM (offsets from the
// signal); after the last one it sends SIGKILL and observes once more after
// KillSettle.
var (
	StopSchedule = []time.Duration{100 * time.Millisecond, 500 * time.Millisecond, time.Second}
	KillSettle   = 100 * time.Millisecond
)

// Provider is the process provider.
type Provider struct {
	cfg     Config
	self    identity
	reapers sync.WaitGroup
}

var (
	_ provider.AgentSandbox = (*Provider)(nil)
	_ provider.Inventory    = (*Provider)(nil)
)

// New builds a process provider rooted at cfg.Root (created if missing).
func New(cfg Config) (*Provider, error) {
	if cfg.Root == "" || !filepath.IsAbs(cfg.Root) {
		return nil, fmt.Errorf("process provider: root %q must be an absolute path", cfg.Root)
	}
	if cfg.ProcRoot == "" {
		cfg.ProcRoot = "/proc"
	}
	if cfg.Sleep == nil {
		cfg.Sleep = pause.Sleep
	}
	if cfg.BaseEnv == nil {
		cfg.BaseEnv = []string{"PATH=" + os.Getenv("PATH")}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.Root, 0o755); err != nil {
		return nil, provider.SetupError("create root", err)
	}
	return &Provider{cfg: cfg, self: selfIdentity()}, nil
}

// SandboxDir is the directory of a sandbox.
func (p *Provider) SandboxDir(sandboxID string) string { return filepath.Join(p.cfg.Root, sandboxID) }

// WorkspaceDir is the working directory of a route's workspace.
func (p *Provider) WorkspaceDir(sandboxID, workspace string) string {
	return filepath.Join(p.cfg.Root, sandboxID, "workspaces", WorkspaceName(workspace))
}

// HomeDir is the HOME of a route's workspace.
func (p *Provider) HomeDir(sandboxID, workspace string) string {
	return filepath.Join(p.cfg.Root, sandboxID, "homes", WorkspaceName(workspace))
}

// Create makes the sandbox tree (idempotent). Failures are classified
// (provider.SetupError): ENOSPC evidence or a failed setup.
func (p *Provider) Create(_ context.Context, sandboxID string) error {
	if err := validSandboxID(sandboxID); err != nil {
		return err
	}
	for _, d := range []string{"workspaces", "homes", "logs"} {
		if err := os.MkdirAll(filepath.Join(p.SandboxDir(sandboxID), d), 0o755); err != nil {
			return provider.SetupError("create sandbox", err)
		}
	}
	return nil
}

// PrepareWorkspace makes a route's workspace and home directories and
// records which route directory they serve (a small file in the home, which
// is also where a full disk shows up as ENOSPC). It reports whether the
// workspace already existed (warm).
func (p *Provider) PrepareWorkspace(ctx context.Context, sandboxID, workspace string) (warm bool, err error) {
	if err := p.Create(ctx, sandboxID); err != nil {
		return false, err
	}
	ws, home := p.WorkspaceDir(sandboxID, workspace), p.HomeDir(sandboxID, workspace)
	if _, err := os.Stat(ws); err == nil {
		warm = true
	}
	for _, d := range []string{ws, home} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return false, provider.SetupError("create workspace", err)
		}
	}
	if err := os.WriteFile(filepath.Join(home, ".agentplane-workspace"), []byte(workspace+"\n"), 0o644); err != nil {
		return false, provider.SetupError("record workspace", err)
	}
	return warm, nil
}

// Launch prepares the workspace and starts the wrapper in its own process
// group with the four markers, HOME, the workspace as working directory,
// spec.Env (reserved names dropped) and spec.ExtraFiles as fds 3, 4, ....
// The child is reaped in the background so that an exited wrapper never
// lingers as a zombie that looks alive.
func (p *Provider) Launch(ctx context.Context, spec provider.LaunchSpec) (provider.Observed, error) {
	m := spec.Markers
	if err := validSandboxID(m.SandboxID); err != nil {
		return provider.Observed{}, err
	}
	if m.InstanceID == "" {
		return provider.Observed{}, errors.New("process provider: launch without instance id")
	}
	if _, err := p.PrepareWorkspace(ctx, m.SandboxID, spec.Workspace); err != nil {
		return provider.Observed{}, err
	}
	name := WorkspaceName(spec.Workspace)
	logPath := filepath.Join(p.SandboxDir(m.SandboxID), "logs", name+"."+WorkspaceName(m.InstanceID)+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return provider.Observed{}, provider.SetupError("open wrapper log", err)
	}
	cmd := exec.Command(spec.Path, spec.Args...)
	cmd.Dir = p.WorkspaceDir(m.SandboxID, spec.Workspace)
	cmd.Env = p.env(spec, name)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = spec.ExtraFiles
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return provider.Observed{}, fmt.Errorf("process provider: start wrapper: %w", err)
	}
	p.reapers.Add(1)
	go func() {
		defer p.reapers.Done()
		_ = cmd.Wait()
		_ = logf.Close()
	}()
	p.cfg.Logger.Info("wrapper launched", "sandbox", m.SandboxID, "runtime_key", m.RuntimeKey,
		"instance", m.InstanceID, "generation", m.Generation, "pid", cmd.Process.Pid)
	return provider.Observed{PID: cmd.Process.Pid, InstanceID: m.InstanceID, Generation: m.Generation, Workspace: name}, nil
}

func (p *Provider) env(spec provider.LaunchSpec, name string) []string {
	reserved := map[string]bool{
		provider.EnvSandbox: true, provider.EnvRuntimeKey: true, provider.EnvInstance: true,
		provider.EnvGeneration: true, EnvWorkspace: true, "HOME": true,
	}
	var env []string
	for _, list := range [][]string{p.cfg.BaseEnv, spec.Env} {
		for _, kv := range list {
			k, _, _ := cutEnv(kv)
			if !reserved[k] {
				env = append(env, kv)
			}
		}
	}
	m := spec.Markers
	return append(env,
		"HOME="+p.HomeDir(m.SandboxID, spec.Workspace),
		EnvWorkspace+"="+name,
		provider.EnvSandbox+"="+m.SandboxID,
		provider.EnvRuntimeKey+"="+m.RuntimeKey,
		provider.EnvInstance+"="+m.InstanceID,
		provider.EnvGeneration+"="+strconv.FormatUint(m.Generation, 10),
	)
}

func cutEnv(kv string) (string, string, bool) {
	for i := 0; i < len(kv); i++ {
		if kv[i] == '=' {
			return kv[:i], kv[i+1:], true
		}
	}
	return kv, "", false
}

// Wait blocks until every child launched by this provider has been reaped.
func (p *Provider) Wait() { p.reapers.Wait() }

// Discover finds the live wrappers whose sandbox and runtime key markers
// equal sandboxID and runtimeKey exactly.
func (p *Provider) Discover(_ context.Context, sandboxID, runtimeKey string) provider.Discovery {
	procs, err := scan(p.cfg.ProcRoot, sandboxID, p.self)
	if err != nil {
		return provider.Discovery{Kind: provider.InspectionFailed, Err: err}
	}
	var obs []provider.Observed
	for _, pe := range procs {
		if pe.hasKey && pe.runtimeKey == runtimeKey || !pe.hasKey && runtimeKey == "" {
			obs = append(obs, observed(pe))
		}
	}
	if len(obs) == 0 {
		return provider.Discovery{Kind: provider.Absent}
	}
	return provider.Discovery{Kind: provider.Present, Observed: obs}
}

// DiscoverSandbox finds every live process carrying the sandbox's marker,
// grouped by runtime key (a missing key marker groups under "").
func (p *Provider) DiscoverSandbox(_ context.Context, sandboxID string) provider.SandboxDiscovery {
	procs, err := scan(p.cfg.ProcRoot, sandboxID, p.self)
	if err != nil {
		return provider.SandboxDiscovery{Kind: provider.InspectionFailed, Err: err}
	}
	byKey := map[string][]provider.Observed{}
	for _, pe := range procs {
		byKey[pe.runtimeKey] = append(byKey[pe.runtimeKey], observed(pe))
	}
	if len(byKey) == 0 {
		return provider.SandboxDiscovery{Kind: provider.Absent}
	}
	return provider.SandboxDiscovery{Kind: provider.Present, ByRuntimeKey: byKey}
}

func observed(pe procEntry) provider.Observed {
	return provider.Observed{PID: pe.pid, InstanceID: pe.instance, Generation: pe.generation, Unmarked: pe.unmarked, Workspace: pe.workspace}
}

// Stop sends SIGTERM to the process groups of the target's wrappers,
// observes at 100 ms, 500 ms and 1 s after it, then sends SIGKILL and
// observes once more. Only an observation that could look and found
// nothing yields StopAbsent.
func (p *Provider) Stop(ctx context.Context, t provider.StopTarget) provider.StopResult {
	d := p.matchStop(ctx, t)
	if d.Kind != provider.Present {
		return stopResult(d)
	}
	p.signal(d.Observed, syscall.SIGTERM)
	var elapsed time.Duration
	for _, at := range StopSchedule {
		if err := p.cfg.Sleep(ctx, at-elapsed); err != nil {
			return provider.StopResult{Kind: provider.StopInspectionFailed, Err: err}
		}
		elapsed = at
		d = p.matchStop(ctx, t)
		if d.Kind == provider.Absent {
			return provider.StopResult{Kind: provider.StopAbsent}
		}
		if d.Kind == provider.Present {
			p.signal(d.Observed, syscall.SIGTERM) // a straggler that joined late
		}
	}
	if d.Kind == provider.Present {
		p.cfg.Logger.Warn("wrapper ignored SIGTERM, killing", "sandbox", t.SandboxID, "runtime_key", t.RuntimeKey, "count", len(d.Observed))
		p.signal(d.Observed, syscall.SIGKILL)
	}
	if err := p.cfg.Sleep(ctx, KillSettle); err != nil {
		return provider.StopResult{Kind: provider.StopInspectionFailed, Err: err}
	}
	return stopResult(p.matchStop(ctx, t))
}

func stopResult(d provider.Discovery) provider.StopResult {
	switch d.Kind {
	case provider.Absent:
		return provider.StopResult{Kind: provider.StopAbsent}
	case provider.Present:
		return provider.StopResult{Kind: provider.StopStillPresent}
	default:
		return provider.StopResult{Kind: provider.StopInspectionFailed, Err: d.Err}
	}
}

// matchStop discovers the target: every wrapper of the key, or only one
// instance.
func (p *Provider) matchStop(ctx context.Context, t provider.StopTarget) provider.Discovery {
	d := p.Discover(ctx, t.SandboxID, t.RuntimeKey)
	if d.Kind != provider.Present || t.InstanceID == "" {
		return d
	}
	var keep []provider.Observed
	for _, o := range d.Observed {
		if o.InstanceID == t.InstanceID {
			keep = append(keep, o)
		}
	}
	if len(keep) == 0 {
		return provider.Discovery{Kind: provider.Absent}
	}
	return provider.Discovery{Kind: provider.Present, Observed: keep}
}

// signal sends sig to each process's group (wrappers lead their own group,
// so the runtime they supervise goes too) and to the process itself, in
// case an unmarked one shares a group. Our own group is never signalled.
func (p *Provider) signal(obs []provider.Observed, sig syscall.Signal) {
	own := syscall.Getpgrp()
	for _, o := range obs {
		if _, pgid, err := readStat(filepath.Join(p.cfg.ProcRoot, strconv.Itoa(o.PID), "stat")); err == nil && pgid > 1 && pgid != own {
			_ = syscall.Kill(-pgid, sig)
		}
		_ = syscall.Kill(o.PID, sig)
	}
}

// KeepAlive is a no-op: a directory tree does not expire.
func (p *Provider) KeepAlive(context.Context, string) error { return nil }

// Capacity measures the free bytes (for unprivileged users) of the
// filesystem holding the sandbox.
func (p *Provider) Capacity(_ context.Context, sandboxID string) provider.Capacity {
	if err := validSandboxID(sandboxID); err != nil {
		return provider.Capacity{Kind: provider.CapacityUnmeasurable, Err: err}
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(p.SandboxDir(sandboxID), &st); err != nil {
		return provider.Capacity{Kind: provider.CapacityUnmeasurable, Err: fmt.Errorf("statfs: %w", err)}
	}
	return provider.Capacity{Kind: provider.CapacityMeasured, AvailableBytes: st.Bavail * uint64(st.Bsize)}
}

// Delete removes one workspace and its home (DeleteWorkspace, on a shared
// sandbox) or the whole sandbox tree (DeleteRecovery). The caller stops the
// wrappers first.
func (p *Provider) Delete(_ context.Context, sandboxID, workspace string, reason provider.DeleteReason) error {
	if err := validSandboxID(sandboxID); err != nil {
		return err
	}
	switch reason {
	case provider.DeleteWorkspace:
		return p.removeWorkspace(sandboxID, WorkspaceName(workspace))
	case provider.DeleteRecovery:
		if err := os.RemoveAll(p.SandboxDir(sandboxID)); err != nil {
			return fmt.Errorf("process provider: delete sandbox: %w", err)
		}
		return nil
	}
	return fmt.Errorf("process provider: unknown delete reason %d", reason)
}

func (p *Provider) removeWorkspace(sandboxID, name string) error {
	for _, d := range []string{"workspaces", "homes"} {
		if err := os.RemoveAll(filepath.Join(p.SandboxDir(sandboxID), d, name)); err != nil {
			return fmt.Errorf("process provider: delete workspace: %w", err)
		}
	}
	return nil
}
