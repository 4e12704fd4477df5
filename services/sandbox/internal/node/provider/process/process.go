// Package process is the process provider of the AgentSandbox seam
// (DESIGN.md 3.3): a sandbox is a directory tree on this node and wrappers
// are child processes in their own process groups.
//
// Layout under Config.Root:
//
//	<root>/<sandbox-id>/workspaces/<name>   working directory of a workspace's wrapper
//	<root>/<sandbox-id>/homes/<key>         HOME of a runtime key's wrapper
//	<root>/<sandbox-id>/logs/<name>.<instance>.log   the wrapper's stdout and stderr
//
// where <name> is WorkspaceName(route workspace directory) and <key> is
// WorkspaceName(runtime key): the directory under the worktree contract (so
// the same name as its workspace), the session under per_session. A home
// goes with its runtime key (DeleteHome, once the key's wrapper is verified
// absent after its last route's release); a workspace stays warm. Discovery never
// trusts memory of what it started: it reads the markers of the processes in
// the service's own PID namespace (/proc/<pid>/environ) and finds what runs
// inside each sandbox by the process tree below them (proc.go), so it finds
// wrappers of a previous incarnation of the service (after kill -9) as well
// as its own.
package process

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"agentplane.dev/pkg/pause"
	"agentplane.dev/services/sandbox/internal/agent/command"
	"agentplane.dev/services/sandbox/internal/node/boundary"
	"agentplane.dev/services/sandbox/internal/node/cgroup"
	"agentplane.dev/services/sandbox/internal/node/provider"
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
	// Deployment names this deployment in every wrapper's markers (default:
	// derived from Root); discovery only ever matches its own deployment and
	// root, so two deployments on one host never touch each other's wrappers.
	Deployment string
	// Isolation runs each wrapper behind the boundary (DESIGN.md 3.3); nil
	// is SANDBOX_ISOLATION=none.
	Isolation *boundary.Config
	// Cgroups puts each isolated runtime key in its own cgroup with
	// CgroupLimits (limits.go); nil: no cgroup limits on this host.
	Cgroups      *cgroup.Manager
	CgroupLimits cgroup.Limits
	// DiskQuota bounds each sandbox's directory (workspaces, homes, logs);
	// 0: none (limits.go).
	DiskQuota uint64
	// MemoryLimit is sampled per runtime key when Cgroups is nil (memory.go);
	// 0: none.
	MemoryLimit uint64
	// Nice, when Cgroups is nil and the boundary is on, lowers each
	// sandbox's scheduling weight (nice value and SCHED_BATCH, sched.go):
	// weighting, not a cap. 0: none.
	Nice int
}

// DeploymentOf is the default deployment id of a sandbox root.
func DeploymentOf(root string) string {
	sum := sha256.Sum256([]byte(filepath.Clean(root)))
	return "d-" + hex.EncodeToString(sum[:6])
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
	scope   scope
	reapers sync.WaitGroup
	groups  groups // limits.go
	pool    pool   // pool.go
}

var (
	_ provider.AgentSandbox = (*Provider)(nil)
	_ provider.Inventory    = (*Provider)(nil)
	_ provider.Pool         = (*Provider)(nil)
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
	if cfg.Deployment == "" {
		cfg.Deployment = DeploymentOf(cfg.Root)
	}
	if err := os.MkdirAll(cfg.Root, 0o755); err != nil {
		return nil, provider.SetupError("create root", err)
	}
	return &Provider{cfg: cfg, scope: scope{deployment: cfg.Deployment, root: cfg.Root}}, nil
}

// SandboxDir is the directory of a sandbox.
func (p *Provider) SandboxDir(sandboxID string) string { return filepath.Join(p.cfg.Root, sandboxID) }

// WorkspaceDir is the working directory of a route's workspace.
func (p *Provider) WorkspaceDir(sandboxID, workspace string) string {
	return filepath.Join(p.cfg.Root, sandboxID, "workspaces", WorkspaceName(workspace))
}

// HomeDir is the HOME of a runtime key's wrapper.
func (p *Provider) HomeDir(sandboxID, runtimeKey string) string {
	return filepath.Join(p.cfg.Root, sandboxID, "homes", WorkspaceName(runtimeKey))
}

// Create makes the sandbox tree (idempotent). Failures are classified
// (provider.SetupError): ENOSPC evidence or a failed setup.
func (p *Provider) Create(_ context.Context, sandboxID string) error {
	if err := validSandboxID(sandboxID); err != nil {
		return err
	}
	return p.createTree(sandboxID)
}

// createTree makes the tree of a sandbox or of a pooled one (pool.go).
func (p *Provider) createTree(sandboxID string) error {
	for _, d := range []string{"workspaces", "homes", "logs"} {
		if err := os.MkdirAll(filepath.Join(p.SandboxDir(sandboxID), d), 0o755); err != nil {
			return provider.SetupError("create sandbox", err)
		}
	}
	return nil
}

// StateKept reports whether the workspace and the runtime key's home are
// both there (provider.StateKeeper).
func (p *Provider) StateKept(_ context.Context, sandboxID, workspace, runtimeKey string) (bool, error) {
	if err := validSandboxID(sandboxID); err != nil {
		return false, err
	}
	for _, d := range []string{p.WorkspaceDir(sandboxID, workspace), p.HomeDir(sandboxID, runtimeKey)} {
		fi, err := os.Stat(d)
		if errors.Is(err, fs.ErrNotExist) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		if !fi.IsDir() {
			return false, nil
		}
	}
	return true, nil
}

// PrepareWorkspace makes a route's workspace and its runtime key's home
// and records which route directory they serve (a small file in the home,
// which is also where a full disk shows up as ENOSPC). It reports whether
// the workspace already existed (warm).
func (p *Provider) PrepareWorkspace(_ context.Context, sandboxID, workspace, runtimeKey string) (warm bool, err error) {
	if err := validSandboxID(sandboxID); err != nil && !isPoolID(sandboxID) {
		return false, err
	}
	if err := p.createTree(sandboxID); err != nil {
		return false, err
	}
	ws, home := p.WorkspaceDir(sandboxID, workspace), p.HomeDir(sandboxID, runtimeKey)
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
	if cred := p.credential(); cred != nil {
		// The sandbox's own user owns its workspace and home: nothing else
		// on the host is writable (or, when not world-readable, readable) to it.
		for _, d := range []string{ws, home} {
			if err := os.Lchown(d, int(cred.Uid), int(cred.Gid)); err != nil {
				return false, provider.SetupError("chown workspace", err)
			}
		}
	}
	return warm, nil
}

// Launch prepares the workspace and starts the wrapper in its own process
// group with the four markers, HOME, the workspace as working directory,
// spec.Env (reserved names dropped), spec.ExtraFiles as fds 3, 4, ... and
// spec.Identity (flags and a credential pipe). A fresh runtime key (no
// workspace or home yet) whose shape the pool holds takes a pooled
// wrapper instead (pool.go). The child is reaped in the background so that
// an exited wrapper never lingers as a zombie that looks alive.
func (p *Provider) Launch(ctx context.Context, spec provider.LaunchSpec) (provider.Observed, error) {
	m := spec.Markers
	if err := validSandboxID(m.SandboxID); err != nil {
		return provider.Observed{}, err
	}
	if m.InstanceID == "" {
		return provider.Observed{}, errors.New("process provider: launch without instance id")
	}
	if o, ok := p.claim(ctx, spec); ok {
		return o, nil
	}
	var credR *os.File
	if id := spec.Identity; id != nil {
		r, w, err := os.Pipe()
		if err != nil {
			return provider.Observed{}, err
		}
		_, err = w.WriteString(id.Credential)
		_ = w.Close()
		if err != nil {
			_ = r.Close()
			return provider.Observed{}, err
		}
		credR = r
		defer credR.Close()
		spec.Args = append(slices.Clone(spec.Args), "--allocation", id.Allocation,
			"--fence-token", strconv.FormatUint(id.FenceToken, 10),
			"--credential-fd", strconv.Itoa(3+len(spec.ExtraFiles)))
		spec.ExtraFiles = append(slices.Clone(spec.ExtraFiles), credR)
	}
	o, _, err := p.start(ctx, spec)
	return o, err
}

// started is one launch the provider reaps: what its reaper undoes when
// the namespace is gone, which a claim (pool.go) moves to the claiming
// runtime key.
type started struct {
	mu       sync.Mutex
	rec      launchRec
	record   string        // the namespace record's path ("" until written, or none)
	recorded chan struct{} // closed once the namespace record was attempted
	initPID  int
	exited   chan struct{} // closed once the launch was reaped
}

// start launches spec's wrapper (see Launch) and its reaper.
func (p *Provider) start(ctx context.Context, spec provider.LaunchSpec) (provider.Observed, *started, error) {
	m := spec.Markers
	if iso := p.cfg.Isolation; iso != nil {
		if err := iso.Check(p.mount(spec)); err != nil {
			return provider.Observed{}, nil, fmt.Errorf("%w: %w", provider.ErrDirectoryReserved, err)
		}
	}
	if _, err := p.PrepareWorkspace(ctx, m.SandboxID, spec.Workspace, m.RuntimeKey); err != nil {
		return provider.Observed{}, nil, err
	}
	name := WorkspaceName(spec.Workspace)
	logPath := filepath.Join(p.SandboxDir(m.SandboxID), "logs", name+"."+WorkspaceName(m.InstanceID)+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return provider.Observed{}, nil, provider.SetupError("open wrapper log", err)
	}
	cs, extra, err := p.command(spec)
	if err != nil {
		_ = logf.Close()
		return provider.Observed{}, nil, err
	}
	cs.Dir = p.WorkspaceDir(m.SandboxID, spec.Workspace)
	cs.Env = p.env(spec, name)
	cs.Stdout, cs.Stderr = logf, logf
	cmd := command.New(context.Background(), cs)
	err = cmd.Start()
	extra.started()
	if err != nil {
		extra.close()
		_ = logf.Close()
		return provider.Observed{}, nil, fmt.Errorf("process provider: start wrapper: %w", err)
	}
	group, err := p.enterGroup(m, cmd.Process.Pid, extra)
	if err != nil {
		// Nothing untrusted ran yet: bubblewrap waits on its block fd.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
		extra.close()
		_ = logf.Close()
		return provider.Observed{}, nil, err
	}
	st := &started{rec: group, recorded: make(chan struct{}), exited: make(chan struct{})}
	p.reapers.Add(1)
	go func() {
		defer p.reapers.Done()
		defer close(st.exited)
		init, initPID := extra.namespaceInit()
		if init >= 0 {
			record := p.recordNamespace(m, name, cmd.Process.Pid, initPID)
			st.mu.Lock()
			st.record, st.initPID = record, initPID
			st.mu.Unlock()
		}
		close(st.recorded)
		_ = cmd.Wait()
		_ = logf.Close()
		if init >= 0 {
			// bubblewrap exits when the wrapper does; whatever the wrapper
			// left behind keeps its namespace's init alive. Ending the init
			// ends the namespace; the record goes once the init is gone.
			_ = unix.PidfdSendSignal(init, syscall.SIGKILL, nil, 0)
			waitExit(init)
			_ = unix.Close(init)
		}
		st.mu.Lock()
		record, rec := st.record, st.rec
		st.mu.Unlock()
		if record != "" {
			_ = os.Remove(record)
		}
		p.leaveGroup(rec)
	}()
	p.cfg.Logger.Info("wrapper launched", "sandbox", m.SandboxID, "runtime_key", m.RuntimeKey,
		"instance", m.InstanceID, "generation", m.Generation, "pid", cmd.Process.Pid)
	return provider.Observed{PID: cmd.Process.Pid, InstanceID: m.InstanceID, Generation: m.Generation, Workspace: name}, st, nil
}

// launchFiles are the descriptors bubblewrap inherits besides the
// wrapper's: the boundary's files (seccomp program, /etc copies), and the
// write end of its --info-fd pipe, on which it names the host pid of the
// namespace's init.
type launchFiles struct {
	boundary     *boundary.Files
	infoW, infoR *os.File
	// blockW, when set, holds bubblewrap before it runs the wrapper
	// (--block-fd) until the sandbox is in its cgroup; blockR is the end
	// bubblewrap inherits.
	blockW, blockR *os.File
	// info is bubblewrap's child pid once read (enterGroup reads it first).
	info    int
	infoErr bool
}

// started closes the parent's copies a child inherited.
func (f *launchFiles) started() {
	if f == nil {
		return
	}
	f.boundary.Close()
	_ = f.infoW.Close()
	if f.blockR != nil {
		_ = f.blockR.Close()
	}
}

func (f *launchFiles) close() {
	if f != nil {
		_ = f.infoR.Close()
		if f.blockW != nil {
			_ = f.blockW.Close()
		}
	}
}

// childPID reads bubblewrap's info once: the host pid of the namespace's
// init, or 0 if bubblewrap said nothing.
func (f *launchFiles) childPID() int {
	if f.info == 0 && !f.infoErr {
		var info struct {
			ChildPID int `json:"child-pid"`
		}
		if err := json.NewDecoder(io.LimitReader(f.infoR, 4096)).Decode(&info); err != nil || info.ChildPID <= 0 {
			f.infoErr = true
		} else {
			f.info = info.ChildPID
		}
	}
	return f.info
}

// namespaceInit reads bubblewrap's info and returns a pidfd and the host
// pid of the namespace's init (-1 without isolation or if bubblewrap said
// nothing).
func (f *launchFiles) namespaceInit() (int, int) {
	if f == nil {
		return -1, 0
	}
	defer f.infoR.Close()
	pid := f.childPID()
	if pid <= 0 {
		return -1, 0
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, 0
	}
	return fd, pid
}

// waitExit blocks until the process of a pidfd has exited (a pidfd polls
// readable then), bounded so a stuck exit never holds the reaper forever.
func waitExit(pidfd int) {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		n, err := unix.Poll(fds, 1000)
		if n > 0 || err != nil && !errors.Is(err, syscall.EINTR) {
			return
		}
	}
}

// command is the wrapper's command: the wrapper itself in its own process
// group, or (isolated) bubblewrap running it behind the boundary, with the
// boundary's files and the info pipe on the descriptors after
// spec.ExtraFiles. Either outlives the service: a restarted service finds
// its wrappers again.
func (p *Provider) command(spec provider.LaunchSpec) (command.Spec, *launchFiles, error) {
	iso := p.cfg.Isolation
	if iso == nil {
		return command.Spec{Path: spec.Path, Args: spec.Args, ExtraFiles: spec.ExtraFiles, Group: true, Outlives: true}, nil, nil
	}
	bf, err := iso.OpenFiles()
	if err != nil {
		return command.Spec{}, nil, fmt.Errorf("process provider: %w", err)
	}
	infoR, infoW, err := os.Pipe()
	if err != nil {
		bf.Close()
		return command.Spec{}, nil, fmt.Errorf("process provider: %w", err)
	}
	mount := p.mount(spec)
	firstFD := 3 + len(spec.ExtraFiles)
	inherited := bf.List()
	lf := &launchFiles{boundary: bf, infoW: infoW, infoR: infoR}
	args := []string{"--info-fd", strconv.Itoa(firstFD + len(inherited))}
	extra := []*os.File{infoW}
	if p.cfg.Cgroups != nil || p.cfg.Nice != 0 {
		if lf.blockR, lf.blockW, err = os.Pipe(); err != nil {
			lf.started()
			lf.close()
			return command.Spec{}, nil, fmt.Errorf("process provider: %w", err)
		}
		args = append(args, "--block-fd", strconv.Itoa(firstFD+len(inherited)+1))
		extra = append(extra, lf.blockR)
	}
	args = append(append(args, iso.Args(mount, bf, firstFD)...), spec.Path)
	return command.Spec{
		Path: iso.Bwrap, Args: append(args, spec.Args...), Group: true, Outlives: true, Credential: iso.Credential(),
		ExtraFiles: append(append(append([]*os.File{}, spec.ExtraFiles...), inherited...), extra...),
	}, lf, nil
}

// mount is what a wrapper's sandbox binds: the workspace at the route's
// directory (spec.Workspace), so the wrapper and its runtime work at the
// session's path and never see the host's layout (DESIGN.md 3.6).
func (p *Provider) mount(spec provider.LaunchSpec) boundary.Mount {
	m := spec.Markers
	return boundary.Mount{
		Workspace: p.WorkspaceDir(m.SandboxID, spec.Workspace), At: spec.Workspace,
		Home: p.HomeDir(m.SandboxID, m.RuntimeKey), Program: spec.Path,
	}
}

func (p *Provider) credential() *syscall.Credential {
	if p.cfg.Isolation == nil {
		return nil
	}
	return p.cfg.Isolation.Credential()
}

func (p *Provider) env(spec provider.LaunchSpec, name string) []string {
	reserved := map[string]bool{
		provider.EnvSandbox: true, provider.EnvRuntimeKey: true, provider.EnvInstance: true,
		provider.EnvGeneration: true, EnvWorkspace: true, "HOME": true,
		provider.EnvDeployment: true, provider.EnvSandboxRoot: true,
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
		"HOME="+p.HomeDir(m.SandboxID, m.RuntimeKey),
		EnvWorkspace+"="+name,
		provider.EnvSandbox+"="+m.SandboxID,
		provider.EnvRuntimeKey+"="+m.RuntimeKey,
		provider.EnvInstance+"="+m.InstanceID,
		provider.EnvGeneration+"="+strconv.FormatUint(m.Generation, 10),
		provider.EnvDeployment+"="+p.cfg.Deployment,
		provider.EnvSandboxRoot+"="+p.cfg.Root,
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

// units scans /proc for the sandbox's wrappers of this deployment.
func (p *Provider) units(sandboxID string) ([]*unit, error) {
	if err := validSandboxID(sandboxID); err != nil {
		return nil, err
	}
	return p.scan(sandboxID)
}

// scan finds the wrappers of a sandbox or of a pooled one.
func (p *Provider) scan(sandboxID string) ([]*unit, error) {
	records, err := p.records(sandboxID)
	if err != nil {
		return nil, err
	}
	t, err := scanAll(p.cfg.ProcRoot)
	if err != nil {
		return nil, err
	}
	return units(t, p.scope, sandboxID, records)
}

func (p *Provider) runDir(sandboxID string) string {
	return filepath.Join(p.SandboxDir(sandboxID), "run")
}

// records reads the sandbox's namespace records; a record that cannot be
// read or parsed is an inspection failure (it may name a live namespace).
func (p *Provider) records(sandboxID string) ([]nsRecord, error) {
	ents, err := os.ReadDir(p.runDir(sandboxID))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list namespace records: %w", err)
	}
	var out []nsRecord
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(p.runDir(sandboxID), e.Name()))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		var r nsRecord
		if err == nil {
			err = json.Unmarshal(b, &r)
		}
		if err != nil {
			return nil, fmt.Errorf("namespace record %s: %w", e.Name(), err)
		}
		out = append(out, r)
	}
	return out, nil
}

// recordNamespace writes the record of a launched wrapper's namespace and
// returns its path. A record that cannot be written (the disk full, /proc
// unreadable) is logged with why, and "" returned: the namespace is then
// found through its bubblewrap only, which a wrapper that outlives its
// bubblewrap escapes.
func (p *Provider) recordNamespace(m provider.Markers, workspace string, anchorPID, initPID int) string {
	path, err := p.writeNamespaceRecord(m, workspace, anchorPID, initPID)
	if err != nil {
		p.cfg.Logger.Warn("namespace record not written: the namespace is found through its bubblewrap only",
			"sandbox", m.SandboxID, "runtime_key", m.RuntimeKey, "instance", m.InstanceID,
			"no_space", provider.IsENOSPCEvidence(err, ""), "err", err)
		return ""
	}
	return path
}

func (p *Provider) writeNamespaceRecord(m provider.Markers, workspace string, anchorPID, initPID int) (string, error) {
	return p.writeRecord(m, nsRecordFor(m, workspace, anchorPID, initPID, ""))
}

// nsRecordFor is the record of a namespace whose bubblewrap and init are
// named (their start times read when written); pool names the sandbox
// marker of a claimed pooled wrapper.
func nsRecordFor(m provider.Markers, workspace string, anchorPID, initPID int, pool string) nsRecord {
	return nsRecord{RuntimeKey: m.RuntimeKey, Instance: m.InstanceID, Generation: m.Generation, Workspace: workspace,
		AnchorPID: anchorPID, InitPID: initPID, Pool: pool}
}

// writeRecord writes r (with its processes' start times) under the run/
// directory of m's sandbox, named by m's instance.
func (p *Provider) writeRecord(m provider.Markers, r nsRecord) (string, error) {
	anchor, err := readStat(filepath.Join(p.cfg.ProcRoot, strconv.Itoa(r.AnchorPID), "stat"))
	if err != nil {
		return "", fmt.Errorf("read the bubblewrap's stat: %w", err)
	}
	r.AnchorStart = anchor.start
	if r.InitPID != 0 { // 0: no namespace (no boundary), the wrapper is the anchor
		init, err := readStat(filepath.Join(p.cfg.ProcRoot, strconv.Itoa(r.InitPID), "stat"))
		if err != nil {
			return "", fmt.Errorf("read the namespace init's stat: %w", err)
		}
		r.InitStart = init.start
	}
	b, err := json.Marshal(r)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(p.runDir(m.SandboxID), 0o700); err != nil {
		return "", err
	}
	path := filepath.Join(p.runDir(m.SandboxID), WorkspaceName(m.InstanceID)+".json")
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		_ = os.Remove(tmp)
		return "", err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return "", err
	}
	return path, nil
}

// keyOf is a unit's runtime key marker ("" and false when it has none).
func keyOf(u *unit) (string, bool) {
	k, ok := u.anchor.vars[provider.EnvRuntimeKey]
	return k, ok
}

// Discover finds the live wrappers whose sandbox and runtime key markers
// equal sandboxID and runtimeKey exactly: one Observed per launched wrapper,
// present while any process of it (inside its namespaces too) remains.
func (p *Provider) Discover(_ context.Context, sandboxID, runtimeKey string) provider.Discovery {
	us, err := p.units(sandboxID)
	if err != nil {
		return provider.Discovery{Kind: provider.InspectionFailed, Err: err}
	}
	var obs []provider.Observed
	for _, u := range matchKey(us, runtimeKey) {
		obs = append(obs, observed(u))
	}
	if len(obs) == 0 {
		return provider.Discovery{Kind: provider.Absent}
	}
	return provider.Discovery{Kind: provider.Present, Observed: obs}
}

func matchKey(us []*unit, runtimeKey string) []*unit {
	var out []*unit
	for _, u := range us {
		if k, has := keyOf(u); has && k == runtimeKey || !has && runtimeKey == "" {
			out = append(out, u)
		}
	}
	return out
}

// DiscoverSandbox finds every live wrapper carrying the sandbox's marker,
// grouped by runtime key (a missing key marker groups under "").
func (p *Provider) DiscoverSandbox(_ context.Context, sandboxID string) provider.SandboxDiscovery {
	us, err := p.units(sandboxID)
	if err != nil {
		return provider.SandboxDiscovery{Kind: provider.InspectionFailed, Err: err}
	}
	byKey := map[string][]provider.Observed{}
	for _, u := range us {
		k, _ := keyOf(u)
		byKey[k] = append(byKey[k], observed(u))
	}
	if len(byKey) == 0 {
		return provider.SandboxDiscovery{Kind: provider.Absent}
	}
	return provider.SandboxDiscovery{Kind: provider.Present, ByRuntimeKey: byKey}
}

func observed(u *unit) provider.Observed {
	v := u.anchor.vars
	o := provider.Observed{PID: u.anchor.pid, Workspace: v[EnvWorkspace]}
	inst, hasInst := v[provider.EnvInstance]
	gen, genErr := strconv.ParseUint(v[provider.EnvGeneration], 10, 64)
	if !hasInst || inst == "" || genErr != nil {
		o.Unmarked = true
	} else {
		o.InstanceID, o.Generation = inst, gen
	}
	return o
}

// Stop sends SIGTERM to the target's wrappers, observes at 100 ms, 500 ms
// and 1 s after it, then sends SIGKILL to everything of them and observes
// once more. Only an observation that could look and found nothing yields
// StopAbsent.
func (p *Provider) Stop(ctx context.Context, t provider.StopTarget) provider.StopResult {
	r := p.stopUnits(ctx, func() ([]*unit, error) {
		us, err := p.units(t.SandboxID)
		if err != nil {
			return nil, err
		}
		var keep []*unit
		for _, u := range matchKey(us, t.RuntimeKey) {
			if t.InstanceID == "" || observed(u).InstanceID == t.InstanceID {
				keep = append(keep, u)
			}
		}
		return keep, nil
	})
	if r.Kind == provider.StopStillPresent {
		p.cfg.Logger.Warn("wrapper still present after the kill sequence", "sandbox", t.SandboxID, "runtime_key", t.RuntimeKey)
	}
	return r
}

// stopUnits terminates the units find names, then kills what is left after
// StopSchedule, and verifies their absence.
func (p *Provider) stopUnits(ctx context.Context, find func() ([]*unit, error)) provider.StopResult {
	match := func() ([]*unit, provider.Discovery) {
		us, err := find()
		switch {
		case err != nil:
			return nil, provider.Discovery{Kind: provider.InspectionFailed, Err: err}
		case len(us) == 0:
			return nil, provider.Discovery{Kind: provider.Absent}
		}
		return us, provider.Discovery{Kind: provider.Present}
	}
	us, d := match()
	if d.Kind != provider.Present {
		return stopResult(d)
	}
	p.terminate(us)
	var elapsed time.Duration
	for _, at := range StopSchedule {
		if err := p.cfg.Sleep(ctx, at-elapsed); err != nil {
			return provider.StopResult{Kind: provider.StopInspectionFailed, Err: err}
		}
		elapsed = at
		us, d = match()
		if d.Kind == provider.Absent {
			return provider.StopResult{Kind: provider.StopAbsent}
		}
		if d.Kind == provider.Present {
			p.terminate(us) // a straggler that joined late
		}
	}
	if d.Kind == provider.Present {
		p.cfg.Logger.Warn("wrapper ignored SIGTERM, killing", "count", len(us))
		p.kill(us)
	}
	if err := p.cfg.Sleep(ctx, KillSettle); err != nil {
		return provider.StopResult{Kind: provider.StopInspectionFailed, Err: err}
	}
	_, d = match()
	return stopResult(d)
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

// terminate asks each unit's wrapper to stop: behind the boundary the
// processes bubblewrap's init started (the wrapper, which stops its runtime
// and then everything else in its namespace, and whatever was reparented to
// the init); without it the wrapper's process group (its runtime goes too)
// and the wrapper itself, in case an unmarked one shares a group.
func (p *Provider) terminate(us []*unit) {
	for _, u := range us {
		if len(u.inits) == 0 {
			p.signalGroup(u.anchor, syscall.SIGTERM)
			continue
		}
		for _, m := range u.members {
			for _, in := range u.inits {
				if m.ppid == in.pid {
					p.signal(m, syscall.SIGTERM)
				}
			}
		}
		if u.orphan {
			p.signal(u.anchor, syscall.SIGKILL) // its bubblewrap is gone: nothing will stop it gracefully
		}
	}
}

// kill ends each unit outright: the anchor, the namespaces' inits (the
// kernel kills every process of a PID namespace whose init dies) and every
// member, in case one is slow to go.
func (p *Provider) kill(us []*unit) {
	for _, u := range us {
		if len(u.inits) == 0 {
			p.signalGroup(u.anchor, syscall.SIGKILL)
		}
		p.signal(u.anchor, syscall.SIGKILL)
		for _, in := range u.inits {
			p.signal(in, syscall.SIGKILL)
		}
		for _, m := range u.members {
			p.signal(m, syscall.SIGKILL)
		}
	}
}

// signalGroup signals a process's group (never our own) and the process.
func (p *Provider) signalGroup(pi *procInfo, sig syscall.Signal) {
	if pi.pgid > 1 && pi.pgid != syscall.Getpgrp() {
		_ = syscall.Kill(-pi.pgid, sig)
	}
	p.signal(pi, sig)
}

// signal sends sig through a pidfd opened on the process and checked to
// still be the one scanned (same start time), so a pid reused since the
// scan is never signalled.
func (p *Provider) signal(pi *procInfo, sig syscall.Signal) {
	fd, err := unix.PidfdOpen(pi.pid, 0)
	if err != nil {
		return // gone (ESRCH), or a kernel without pidfds: nothing safe to signal
	}
	defer func() { _ = unix.Close(fd) }()
	st, err := readStat(filepath.Join(p.cfg.ProcRoot, strconv.Itoa(pi.pid), "stat"))
	if err != nil || st.start != pi.start {
		return
	}
	_ = unix.PidfdSendSignal(fd, sig, nil, 0)
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

// RootCapacity measures the free bytes of the sandbox root's filesystem.
func (p *Provider) RootCapacity() provider.Capacity {
	var st syscall.Statfs_t
	if err := syscall.Statfs(p.cfg.Root, &st); err != nil {
		return provider.Capacity{Kind: provider.CapacityUnmeasurable, Err: fmt.Errorf("statfs: %w", err)}
	}
	return provider.Capacity{Kind: provider.CapacityMeasured, AvailableBytes: st.Bavail * uint64(st.Bsize)}
}

// Delete removes one workspace and its home (DeleteWorkspace, on a shared
// sandbox), a runtime key's home (DeleteHome: workspace names the key) or
// the whole tree of a sandbox with no session left (DeleteReleased). The
// caller stops the wrappers first. A recovery never removes a tree: it
// takes only what is recreatable (RecoverKey).
func (p *Provider) Delete(_ context.Context, sandboxID, workspace string, reason provider.DeleteReason) error {
	if err := validSandboxID(sandboxID); err != nil {
		return err
	}
	switch reason {
	case provider.DeleteWorkspace:
		return p.removeWorkspace(sandboxID, WorkspaceName(workspace))
	case provider.DeleteHome:
		if err := removeTree(p.HomeDir(sandboxID, workspace)); err != nil {
			return fmt.Errorf("process provider: delete home: %w", err)
		}
		return nil
	case provider.DeleteReleased:
		if err := removeTree(p.SandboxDir(sandboxID)); err != nil {
			return fmt.Errorf("process provider: delete released sandbox: %w", err)
		}
		return nil
	}
	return fmt.Errorf("process provider: unknown delete reason %d", reason)
}

// removeWorkspace removes a workspace, the home of the same name and the
// logs of the wrappers that served it (logs/<name>.<instance>.log).
func (p *Provider) removeWorkspace(sandboxID, name string) error {
	for _, d := range []string{"workspaces", "homes"} {
		if err := removeTree(filepath.Join(p.SandboxDir(sandboxID), d, name)); err != nil {
			return fmt.Errorf("process provider: delete workspace: %w", err)
		}
	}
	logs, err := filepath.Glob(filepath.Join(p.SandboxDir(sandboxID), "logs", name+".*.log"))
	if err != nil {
		return fmt.Errorf("process provider: delete logs: %w", err)
	}
	for _, l := range logs {
		if err := os.Remove(l); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("process provider: delete logs: %w", err)
		}
	}
	return nil
}

// removeTree removes dir and everything in it. What ran inside may have
// taken its own permissions away (chmod 000 on a directory); once it is
// gone the service owns the tree (or is root), so directories are opened
// up and the removal tried again.
func removeTree(dir string) error {
	err := os.RemoveAll(dir)
	if err == nil || !errors.Is(err, fs.ErrPermission) {
		return err
	}
	// WalkDir visits a directory before it reads it, so opening it there
	// lets the walk go on into it.
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, _ error) error {
		if d != nil && d.IsDir() {
			_ = os.Chmod(path, 0o700)
		}
		return nil
	})
	return os.RemoveAll(dir)
}
