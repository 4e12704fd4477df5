package process

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// The warm pool (DESIGN.md 3.8): wrappers started, boundary and all, bound
// to no sandbox and no tenant, their agent starting, each waiting on a
// claim socket only this provider holds. A pooled wrapper lives under its own
// id (<root>/.pool-<hex>: a leading dot, so no sandbox id can name it) and
// talks to no service until claimed. A claim hands one to one runtime key,
// once: its workspace and home are renamed into the claiming sandbox's
// tree (a bind mount follows its directory across a rename, so the
// sandbox sees the same directories), a namespace record in that sandbox's
// run/ makes discovery find it under the key, its cgroup is re-labelled,
// its pool directory removed, and only then is the identity written to the
// claim socket. Only a pooled wrapper that said it is ready on that socket
// (it runs inside its boundary, every mount made) is claimed: renaming a
// directory bubblewrap has yet to mount would end the sandbox. A socket
// that closes without a claim (the entry destroyed, or this service gone)
// ends the pooled wrapper, so a pooled sandbox never outlives the process
// that could hand it out, and never serves two.

// poolPrefix starts every pooled wrapper's id; validSandboxID refuses it.
const poolPrefix = ".pool-"

// poolKey is the runtime key marker of a pooled wrapper before its claim.
const poolKey = "pool"

func isPoolID(id string) bool {
	return strings.HasPrefix(id, poolPrefix) && !strings.ContainsAny(id, "/\\\x00") && len(id) <= 64
}

type pooled struct {
	id, label, workspace string
	instance             string
	claimW               *os.File // this service's end of the claim socket
	pid                  int      // its bubblewrap (or the wrapper without the boundary)
	st                   *started
	ready                bool // it said so on the claim socket (under pool.mu)
}

type pool struct {
	mu     sync.Mutex
	idle   map[string][]*pooled // by shape
	labels map[string]string    // every shape filled, by shape: its label
	obs    provider.PoolObserver
}

// shapeOf is what a pooled wrapper must share with a launch it serves:
// the command, its arguments and environment (the workspace directory is
// compared apart).
func shapeOf(spec provider.LaunchSpec) string {
	h := sha256.New()
	for _, list := range [][]string{{spec.Path}, spec.Args, spec.Env} {
		for _, s := range list {
			h.Write([]byte(strconv.Itoa(len(s)) + ":" + s))
		}
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))
}

// SetPoolObserver sets who hears of claims and misses.
func (p *Provider) SetPoolObserver(o provider.PoolObserver) {
	p.pool.mu.Lock()
	p.pool.obs = o
	p.pool.mu.Unlock()
}

// FillPool starts one pooled wrapper of spec's shape (its markers and
// identity are ignored: it gets its own) for launches of spec.Workspace.
// label names the shape to the observer and PoolSize.
func (p *Provider) FillPool(ctx context.Context, label string, spec provider.LaunchSpec) error {
	if len(spec.ExtraFiles) > 0 || spec.Identity != nil {
		return errors.New("process provider: a pooled wrapper takes no descriptors and no identity")
	}
	raw := make([]byte, 8)
	_, _ = rand.Read(raw)
	id := poolPrefix + hex.EncodeToString(raw)
	spec.Markers = provider.Markers{SandboxID: id, RuntimeKey: poolKey, InstanceID: "p" + hex.EncodeToString(raw)}
	shape := shapeOf(spec)
	w, r, err := claimSocket()
	if err != nil {
		return err
	}
	spec.Args = append(slices.Clone(spec.Args), "--claim-fd", "3")
	spec.ExtraFiles = []*os.File{r}
	o, st, err := p.start(ctx, spec)
	_ = r.Close()
	if err != nil {
		_ = w.Close()
		_ = os.RemoveAll(p.SandboxDir(id))
		return err
	}
	e := &pooled{id: id, label: label, workspace: spec.Workspace, instance: spec.Markers.InstanceID, claimW: w, pid: o.PID, st: st}
	p.pool.mu.Lock()
	if p.pool.idle == nil {
		p.pool.idle, p.pool.labels = map[string][]*pooled{}, map[string]string{}
	}
	p.pool.idle[shape] = append(p.pool.idle[shape], e)
	p.pool.labels[shape] = label
	p.pool.mu.Unlock()
	p.reapers.Add(2)
	go func() {
		defer p.reapers.Done()
		if provider.ReadReady(w) == nil {
			p.pool.mu.Lock()
			e.ready = true
			p.pool.mu.Unlock()
		}
	}()
	go func() {
		// A pooled wrapper that ends while it waits (its agent died) leaves
		// the pool, its directory with it.
		defer p.reapers.Done()
		<-st.exited
		if p.takeEntry(shape, e) {
			_ = w.Close()
			_ = os.RemoveAll(p.SandboxDir(id))
		}
	}()
	return nil
}

// takeEntry removes e from the idle pool; false when it was not there
// (claimed or drained already).
func (p *Provider) takeEntry(shape string, e *pooled) bool {
	p.pool.mu.Lock()
	defer p.pool.mu.Unlock()
	list := p.pool.idle[shape]
	i := slices.Index(list, e)
	if i < 0 {
		return false
	}
	p.pool.idle[shape] = slices.Delete(list, i, i+1)
	return true
}

// claimSocket is a connected pair: ours, and the pooled wrapper's (its
// --claim-fd). Both ends are close-on-exec here; the child gets its end
// by ExtraFiles.
func claimSocket() (ours, theirs *os.File, err error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("process provider: claim socket: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "claim"), os.NewFile(uintptr(fds[1]), "claim"), nil
}

// PoolSize counts the pooled wrappers by label.
func (p *Provider) PoolSize() map[string]provider.PoolCount {
	p.pool.mu.Lock()
	defer p.pool.mu.Unlock()
	out := map[string]provider.PoolCount{}
	for shape, label := range p.pool.labels {
		c := out[label]
		for _, e := range p.pool.idle[shape] {
			if e.ready {
				c.Ready++
			} else {
				c.Starting++
			}
		}
		out[label] = c
	}
	return out
}

// DrainPool ends every idle pooled wrapper (closing its claim socket is
// enough: it stops its runtime and exits) and removes its directory once
// it is gone.
func (p *Provider) DrainPool(ctx context.Context) {
	p.pool.mu.Lock()
	var all []*pooled
	for shape, list := range p.pool.idle {
		all = append(all, list...)
		delete(p.pool.idle, shape)
	}
	p.pool.mu.Unlock()
	for _, e := range all {
		p.destroy(ctx, e)
	}
}

// destroy ends a pooled wrapper taken out of the pool, and removes its
// directory once it is verified gone.
func (p *Provider) destroy(ctx context.Context, e *pooled) {
	_ = e.claimW.Close()
	if r := p.stopPooled(ctx, e.id); r.Kind == provider.StopAbsent {
		_ = os.RemoveAll(p.SandboxDir(e.id))
	}
}

// stopPooled stops every wrapper of a pooled id.
func (p *Provider) stopPooled(ctx context.Context, id string) provider.StopResult {
	return p.stopUnits(ctx, func() ([]*unit, error) { return p.scan(id) })
}

// SweepPool removes the directories an earlier incarnation's pool left.
// Its wrappers ended with it (their claim sockets closed); a pooled wrapper
// that still runs belongs to a live service on the same root (another
// replica's pool) and is left alone, and so is its directory. A directory
// whose wrappers cannot be inspected stays, and is reported.
func (p *Provider) SweepPool(_ context.Context) error {
	ents, err := os.ReadDir(p.cfg.Root)
	if err != nil {
		return fmt.Errorf("process provider: list the root: %w", err)
	}
	var errs []error
	for _, ent := range ents {
		if !ent.IsDir() || !isPoolID(ent.Name()) {
			continue
		}
		p.pool.mu.Lock()
		mine := false
		for _, list := range p.pool.idle {
			mine = mine || slices.ContainsFunc(list, func(e *pooled) bool { return e.id == ent.Name() })
		}
		p.pool.mu.Unlock()
		if mine {
			continue
		}
		us, err := p.scan(ent.Name())
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("pooled %s not inspected: %w", ent.Name(), err))
		case len(us) == 0:
			if err := os.RemoveAll(filepath.Join(p.cfg.Root, ent.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// claim hands a pooled wrapper of spec's shape to spec's runtime key, if
// the key is fresh and one waits; false: launch cold.
func (p *Provider) claim(ctx context.Context, spec provider.LaunchSpec) (provider.Observed, bool) {
	if spec.Identity == nil || len(spec.ExtraFiles) > 0 {
		return provider.Observed{}, false
	}
	shape := shapeOf(spec)
	p.pool.mu.Lock()
	label, known := p.pool.labels[shape]
	obs := p.pool.obs
	p.pool.mu.Unlock()
	if !known {
		return provider.Observed{}, false
	}
	missed := func(why provider.PoolMiss) (provider.Observed, bool) {
		if obs != nil {
			obs.Missed(label, why)
		}
		return provider.Observed{}, false
	}
	m := spec.Markers
	ws, home := p.WorkspaceDir(m.SandboxID, spec.Workspace), p.HomeDir(m.SandboxID, m.RuntimeKey)
	for _, d := range []string{ws, home} {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) {
			return missed(provider.MissNotFresh)
		}
	}
	var e *pooled
	starting := false
	p.pool.mu.Lock()
	for _, c := range p.pool.idle[shape] {
		if c.workspace == spec.Workspace {
			starting = starting || !c.ready
			if c.ready {
				e = c
				break
			}
		}
	}
	p.pool.mu.Unlock()
	switch {
	case e == nil && starting:
		return missed(provider.MissStarting)
	case e == nil || !p.takeEntry(shape, e):
		return missed(provider.MissEmpty)
	}
	o, undo, err := p.handOver(spec, e)
	if err != nil {
		p.cfg.Logger.Warn("pooled wrapper not claimed; launching cold", "sandbox", m.SandboxID, "runtime_key", m.RuntimeKey, "err", err)
		p.destroy(ctx, e)
		undo()
		return missed(provider.MissClaim)
	}
	if obs != nil {
		obs.Claimed(label)
	}
	p.cfg.Logger.Info("pooled wrapper claimed", "sandbox", m.SandboxID, "runtime_key", m.RuntimeKey,
		"instance", m.InstanceID, "generation", m.Generation, "pid", e.pid)
	return o, true
}

// handOver moves a pooled wrapper's directories, record and cgroup to the
// claiming runtime key, then writes its identity to the claim socket. Until
// the write, the pooled wrapper has talked to no one: a failure (or this
// service dying) before it closes the socket, and the wrapper ends. On a
// failure, undo (called once the wrapper is gone) removes what the claim
// put in the key's tree, so the cold launch that follows starts fresh.
func (p *Provider) handOver(spec provider.LaunchSpec, e *pooled) (o provider.Observed, undo func(), err error) {
	m, id := spec.Markers, spec.Identity
	var placed []string // in the key's tree: fresh before the claim
	undo = func() {
		for _, path := range placed {
			_ = os.RemoveAll(path)
		}
	}
	<-e.st.recorded
	e.st.mu.Lock()
	initPID := e.st.initPID
	e.st.mu.Unlock()
	select {
	case <-e.st.exited:
		return o, undo, errors.New("the pooled wrapper ended")
	default:
	}
	if p.cfg.Isolation != nil && initPID == 0 {
		return o, undo, errors.New("the pooled wrapper's namespace is not recorded")
	}
	if err := p.Create(context.Background(), m.SandboxID); err != nil {
		return o, undo, err
	}
	name := WorkspaceName(spec.Workspace)
	moves := [][2]string{
		{p.WorkspaceDir(e.id, e.workspace), p.WorkspaceDir(m.SandboxID, spec.Workspace)},
		{p.HomeDir(e.id, poolKey), p.HomeDir(m.SandboxID, m.RuntimeKey)},
		{filepath.Join(p.SandboxDir(e.id), "logs", name+"."+WorkspaceName(e.instance)+".log"),
			filepath.Join(p.SandboxDir(m.SandboxID), "logs", name+"."+WorkspaceName(m.InstanceID)+".log")},
	}
	for _, mv := range moves {
		if err := os.Rename(mv[0], mv[1]); err != nil {
			return o, undo, provider.SetupError("claim a pooled sandbox", err)
		}
		placed = append(placed, mv[1])
	}
	if err := os.WriteFile(filepath.Join(p.HomeDir(m.SandboxID, m.RuntimeKey), ".agentplane-workspace"), []byte(spec.Workspace+"\n"), 0o644); err != nil {
		return o, undo, provider.SetupError("record workspace", err)
	}
	record, err := p.writeClaimRecord(m, name, e, initPID)
	if err != nil {
		return o, undo, provider.SetupError("record the claimed namespace", err)
	}
	placed = append(placed, record)
	e.st.mu.Lock()
	old, oldRecord := e.st.rec, e.st.record
	e.st.rec, e.st.record = p.relabel(old, m), record
	e.st.mu.Unlock()
	if oldRecord != "" {
		_ = os.Remove(oldRecord)
	}
	// The pooled directory holds nothing of the wrapper now; it goes
	// before the claim is written, so nothing that finds it later can
	// mistake the claimed wrapper for a pooled one left behind.
	if err := os.RemoveAll(p.SandboxDir(e.id)); err != nil {
		return o, undo, err
	}
	err = provider.WriteClaim(e.claimW, provider.Claim{
		SandboxID: m.SandboxID, RuntimeKey: m.RuntimeKey, InstanceID: m.InstanceID, Generation: m.Generation,
		Allocation: id.Allocation, FenceToken: id.FenceToken, Credential: id.Credential,
	})
	_ = e.claimW.Close()
	if err != nil {
		return o, undo, fmt.Errorf("write the claim: %w", err)
	}
	return provider.Observed{PID: e.pid, InstanceID: m.InstanceID, Generation: m.Generation, Workspace: name}, nil, nil
}

// writeClaimRecord writes the claiming sandbox's namespace record of a
// claimed pooled wrapper (proc.go nsRecord.Pool).
func (p *Provider) writeClaimRecord(m provider.Markers, workspace string, e *pooled, initPID int) (string, error) {
	return p.writeRecord(m, nsRecordFor(m, workspace, e.pid, initPID, e.id))
}
