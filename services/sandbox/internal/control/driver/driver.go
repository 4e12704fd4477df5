// Package driver drives the sandboxes this replica owns: it takes owner
// leases, brings runtime keys' wrappers up through the reconciler's
// launch-or-reuse rule, authenticates wrapper Hellos, routes sessions onto
// their runtime key's wrapper, watches heartbeats and reconnect windows, and
// reports every route change to the session service.
//
// All state of a sandbox lives in memory under the sandbox's mutex and is
// written through to Redis with guarded writes under the owner's fencing
// token; a rejected write means another replica took the sandbox, and this
// replica stops driving it at once.
package driver

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/ownership"
	"agentplane.dev/services/sandbox/internal/control/reconciler"
	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Wrappers is the physical wrapper-lease layer (internal/control/reconciler).
type Wrappers interface {
	Adopt(ctx context.Context, sandboxID string, f reconciler.Fence) error
	Forget(sandboxID string)
	EnsureWrapper(ctx context.Context, sandboxID, runtimeKey string, launch reconciler.LaunchFunc) (reconciler.Decision, error)
	StartupVerified(ctx context.Context, sandboxID, runtimeKey, instance string) error
	DeliveryAccepted(ctx context.Context, sandboxID, runtimeKey, instance string) error
	RetainWarm(ctx context.Context, sandboxID, runtimeKey, instance string, until time.Time) error
	WrapperGone(ctx context.Context, sandboxID, runtimeKey, instance string) error
	RequestStop(ctx context.Context, sandboxID, runtimeKey, reason string) error
	AbsenceVerified(ctx context.Context, sandboxID, runtimeKey string) (bool, time.Duration, error)
	// DeletionAllowed is AbsenceVerified plus DESIGN.md 3.5's exception: an
	// exhausted lease allows deletion after a final observation.
	DeletionAllowed(ctx context.Context, sandboxID, runtimeKey string) (bool, time.Duration, error)
	Lease(ctx context.Context, sandboxID, runtimeKey string) (lease.Lease, error)
}

// Admission admits the workspace of a route directory (warm: no check;
// cold: measure, clean up stale workspaces, measure again). inUse names the
// directories and runtime keys of the sandbox's stored routes: their
// workspaces and homes are a session's work (a suspended or idle-stopped
// one's too) and never stale. Its errors are classified as in
// internal/node/provider (CAPACITY_REJECTED, ENOSPC evidence, unmeasurable).
type Admission interface {
	Admit(ctx context.Context, sandboxID, directory string, inUse []string) error
}

// Config of a Driver.
type Config struct {
	Redis       redis.UniversalClient
	Provider    provider.AgentSandbox
	Wrappers    Wrappers
	Notifier    Notifier
	Credentials Credentials // nil: routes get no handle
	ReplicaID   string
	// AdvertiseAddr is where callers reach this replica; the owner leases it
	// takes name it, so a caller can send sandbox calls to the owner. Empty:
	// callers find the owner through their balancer only.
	AdvertiseAddr string
	OwnerTTL      time.Duration
	Timers        allocation.Timers
	// WrapperCommand is the wrapper program and its leading args.
	WrapperCommand []string
	// ControlAddrs are the sandbox-service addresses wrappers dial.
	ControlAddrs []string
	ProxyURL     string
	// Agents resolves agent profiles; nil: only the scripted runtime.
	Agents *agents.Registry
	// Admission is cold-workspace capacity admission, run before a wrapper
	// is launched; nil admits everything.
	Admission Admission
	// EmptyGrace is how long a sandbox stays owned with no session left
	// before the replica lets it go (releaseIfEmpty); 0: at the next tick.
	EmptyGrace time.Duration
	Logger     *slog.Logger
	Now        func() time.Time
}

// OwnedElsewhereError is ErrOwnedElsewhere naming the replica that owns
// the sandbox, so the caller can ask it directly.
type OwnedElsewhereError struct{ Owner ownership.Holder }

func (e *OwnedElsewhereError) Error() string {
	return ErrOwnedElsewhere.Error() + " (" + e.Owner.Replica + ")"
}

func (e *OwnedElsewhereError) Unwrap() error { return ErrOwnedElsewhere }

// Domain errors (grpcapi maps them).
var (
	ErrOwnedElsewhere = errors.New("sandbox is driven by another replica")
	ErrRouteNotFound  = errors.New("route not found")
	ErrDirectoryMoved = errors.New("route exists with another directory")
	ErrClassMixed     = scope.ErrClassMixed
	ErrScopeNotFound  = errors.New("scope not found")
	ErrShuttingDown   = errors.New("the replica is shutting down")
	// ErrStreamReplaced ends a wrapper stream when the same runtime key
	// said Hello on a newer one.
	ErrStreamReplaced = errors.New("the wrapper stream was replaced by a newer one")
	// ErrStreamOverflow ends a wrapper stream that did not read its frames
	// as fast as the driver sent them.
	ErrStreamOverflow = errors.New("the wrapper did not keep up with its stream")
)

// Metrics the service exports.
type Metrics struct {
	StaleTokenRejections atomic.Int64
	LeaseLosses          atomic.Int64
	Takeovers            atomic.Int64
	CapacityRejections   atomic.Int64
	// RecoveryKeptWorkspaces counts workspaces a recovery kept because
	// they hold something (maybe changes not pushed or exported).
	RecoveryKeptWorkspaces atomic.Int64
}

// Driver drives owned sandboxes.
type Driver struct {
	cfg Config
	log *slog.Logger
	// ctx is the parent of every owned sandbox's context. It is made in
	// New, not taken from Run, because Prepare can arrive before Run
	// starts; Run cancels it when it stops.
	ctx     context.Context
	cancel  context.CancelFunc
	Metrics Metrics

	mu        sync.Mutex
	sandboxes map[string]*sandbox
	acquiring map[string]chan struct{}
	// closing is set when the server's graceful stop begins: wrapper
	// streams are closed and new Hellos refused (see CloseWrapperStreams).
	closing atomic.Bool
	// worktreeCalls are WorktreeRequests waiting for their result, by
	// request id (worktree.go).
	worktreeCalls sync.Map
}

// CloseWrapperStreams ends every wrapper stream and refuses new Hellos from
// now on. The server calls it when its graceful stop begins: a wrapper
// stream never ends by itself, so without this the graceful stop would wait
// for its hard-stop bound on every shutdown. The wrappers reconnect (within
// their reconnect window) to the replica that takes the sandboxes over.
func (d *Driver) CloseWrapperStreams() {
	d.closing.Store(true)
	for _, sb := range d.owned() {
		sb.mu.Lock()
		for _, c := range sb.conns {
			c.close(ErrShuttingDown)
		}
		sb.mu.Unlock()
	}
}

// New builds a driver; Run starts its loops.
func New(cfg Config) *Driver {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Agents == nil {
		cfg.Agents = agents.New(agents.Config{})
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Driver{cfg: cfg, log: cfg.Logger, ctx: ctx, cancel: cancel, sandboxes: map[string]*sandbox{}, acquiring: map[string]chan struct{}{}}
}

// sandbox is one owned sandbox.
type sandbox struct {
	id    string
	owner *ownership.Owner
	stop  context.CancelFunc
	ctx   context.Context

	mu             sync.Mutex
	dropped        bool
	allocationID   string
	routes         map[string]*store.Route
	scopes         map[string]*scope.Scope
	wrappers       map[string]*store.Wrapper
	keyAllocations map[string]*store.KeyAllocation // runtime key → its allocation
	conns          map[string]*Conn                // runtime key → connected wrapper
	handles        map[string]string
	// preparing holds the sessions whose preparation goroutine runs now
	// (one per route at a time, startPreparing); prepareAgain those asked
	// to prepare meanwhile, which run once more when it ends.
	preparing    map[string]bool
	prepareAgain map[string]bool
	// stopped is closed (and cleared) when a wrapper stop of this sandbox
	// completes: route preparation refused while a stop was pending waits
	// on it rather than only on the refusal's RetryAfter.
	stopped chan struct{}
	// memberRetrying / memberRetryAt pace the tick's retries of pending
	// member releases (retryMemberReleases).
	memberRetrying bool
	memberRetryAt  time.Time
	// recovering holds the runtime keys recovering from ENOSPC evidence (or
	// a failed setup) until their wrappers are verified absent and what of
	// them is recreatable is removed (recovery.go).
	recovering map[string]*keyRecovery
	// launching counts the launches of each runtime key in flight on this
	// replica: a starting key not launching here whose wrapper is verified
	// absent is gone (tick.go checkGone).
	launching map[string]int
	// emptySince is when the sandbox was first seen with nothing to drive
	// (zero while it has something): releaseIfEmpty lets it go after
	// EmptyGrace.
	emptySince time.Time
}

// stopSignal returns the channel the next completed stop closes. The
// caller holds sb.mu.
func (sb *sandbox) stopSignal() <-chan struct{} {
	if sb.stopped == nil {
		sb.stopped = make(chan struct{})
	}
	return sb.stopped
}

// WrapperStopped wakes route preparation of the sandbox that waits for a
// wrapper stop (reconciler.Config.Stopped).
func (d *Driver) WrapperStopped(sandboxID, _ string) {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb == nil {
		return
	}
	sb.mu.Lock()
	if sb.stopped != nil {
		close(sb.stopped)
		sb.stopped = nil
	}
	sb.mu.Unlock()
}

// Conn is one authenticated wrapper stream.
type Conn struct {
	SandboxID, RuntimeKey, Instance string
	// Contract is what the wrapper's Hello negotiated for its directory:
	// the contract every route it serves is minted under.
	Contract scope.Contract
	// Send carries the frames to write on the stream, in order (the
	// transport drains it: internal/edge/grpcapi over internal/edge/wrapperconn).
	Send chan ToWrapper
	// Closed closes when the driver ends the stream; Err then says why.
	Closed chan struct{}
	// retired closes once the scope's accepted handles are retired after a
	// wrapper restart (at once when none need retiring): no handle is
	// minted for this wrapper before, so the retirement never revokes one.
	retired   chan struct{}
	closeOnce sync.Once
	why       error
}

// close ends the stream for why; the first reason wins.
func (c *Conn) close(why error) {
	c.closeOnce.Do(func() {
		c.why = why
		close(c.Closed)
	})
}

// Err is why the driver ended the stream: ErrShuttingDown,
// ErrOwnedElsewhere, ErrStreamReplaced or ErrStreamOverflow. Valid once
// Closed is closed.
func (c *Conn) Err() error { return c.why }

func (c *Conn) send(m ToWrapper) bool {
	select {
	case <-c.Closed:
		return false
	case c.Send <- m:
		return true
	default:
		// A wrapper that cannot keep up loses its stream and reconnects.
		c.close(ErrStreamOverflow)
		return false
	}
}

// Run scans for sandboxes without an owner and ticks timers until ctx ends.
func (d *Driver) Run(ctx context.Context) {
	defer d.cancel()
	tick := time.NewTicker(d.tickEvery())
	defer tick.Stop()
	scan := time.NewTicker(max(d.cfg.OwnerTTL/3, 50*time.Millisecond))
	defer scan.Stop()
	d.takeover(ctx)
	for {
		select {
		case <-ctx.Done():
			d.dropAll()
			return
		case <-tick.C:
			d.tick(ctx)
		case <-scan.C:
			d.takeover(ctx)
		}
	}
}

func (d *Driver) tickEvery() time.Duration {
	t := d.cfg.Timers.Heartbeat / 2
	return min(max(t, 50*time.Millisecond), time.Second)
}

// takeover acquires sandboxes whose owner died.
func (d *Driver) takeover(ctx context.Context) {
	ids, err := store.Indexed(ctx, d.cfg.Redis)
	if err != nil {
		return
	}
	for _, id := range ids {
		d.mu.Lock()
		_, owned := d.sandboxes[id]
		d.mu.Unlock()
		if owned {
			continue
		}
		if owner, _, err := ownership.Current(ctx, d.cfg.Redis, id); err != nil || owner != "" {
			continue
		}
		if _, err := d.own(ctx, id); err == nil {
			d.Metrics.Takeovers.Add(1)
			d.log.Info("took over sandbox", "sandbox", id)
		}
	}
}

// own returns the owned sandbox, acquiring its owner lease if free.
func (d *Driver) own(ctx context.Context, id string) (*sandbox, error) {
	for {
		d.mu.Lock()
		if sb, ok := d.sandboxes[id]; ok {
			d.mu.Unlock()
			return sb, nil
		}
		if wait, ok := d.acquiring[id]; ok {
			d.mu.Unlock()
			select {
			case <-wait:
				continue
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		done := make(chan struct{})
		d.acquiring[id] = done
		d.mu.Unlock()
		sb, err := d.acquire(id)
		d.mu.Lock()
		delete(d.acquiring, id)
		if sb != nil {
			d.sandboxes[id] = sb
		}
		close(done)
		d.mu.Unlock()
		if sb != nil {
			d.resume(sb)
		}
		return sb, err
	}
}

func (d *Driver) acquire(id string) (*sandbox, error) {
	sctx, cancel := context.WithCancel(d.ctx)
	o, err := ownership.Acquire(sctx, d.cfg.Redis, id, ownership.Holder{Replica: d.cfg.ReplicaID, Addr: d.cfg.AdvertiseAddr}, d.cfg.OwnerTTL)
	if err != nil {
		cancel()
		if errors.Is(err, ownership.ErrHeld) {
			return nil, d.ownedElsewhere(id)
		}
		return nil, err
	}
	snap, err := store.Load(sctx, d.cfg.Redis, id)
	if err != nil {
		_ = o.Release(context.Background())
		cancel()
		return nil, err
	}
	if len(snap.Unparsable) > 0 {
		d.log.Warn("sandbox records skipped: they do not parse", "sandbox", id, "records", snap.Unparsable)
	}
	if err := store.Index(sctx, d.cfg.Redis, id); err != nil {
		_ = o.Release(context.Background())
		cancel()
		return nil, err
	}
	if err := d.cfg.Wrappers.Adopt(sctx, id, o); err != nil {
		d.log.Warn("reconciler adopt failed", "sandbox", id, "err", err)
	}
	sb := &sandbox{
		id: id, owner: o, stop: cancel, ctx: sctx, allocationID: snap.AllocationID,
		routes: snap.Routes, scopes: snap.Scopes, wrappers: snap.Wrappers, keyAllocations: snap.KeyAllocations,
		conns: map[string]*Conn{}, handles: map[string]string{}, preparing: map[string]bool{}, prepareAgain: map[string]bool{},
	}
	go d.watchOwner(sb)
	return sb, nil
}

// ownedElsewhere names the sandbox's owner when the lease can be read at
// once; the bare error otherwise (the caller retries through its balancer).
func (d *Driver) ownedElsewhere(id string) error {
	ctx, cancel := context.WithTimeout(d.ctx, time.Second)
	defer cancel()
	h, _, err := ownership.CurrentHolder(ctx, d.cfg.Redis, id)
	if err != nil || h.Replica == "" || h.Replica == d.cfg.ReplicaID {
		return ErrOwnedElsewhere
	}
	return &OwnedElsewhereError{Owner: h}
}

// resume re-drives what a previous owner left: live key allocations wait for their
// wrappers to reconnect, routes in preparation are prepared again.
func (d *Driver) resume(sb *sandbox) {
	now := d.cfg.Now()
	sb.mu.Lock()
	var changed []*store.KeyAllocation
	for _, s := range sb.keyAllocations {
		if s.Alloc.Phase == allocation.Connected {
			s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.StreamClosed{Now: now, Instance: s.Alloc.Instance})
			changed = append(changed, s)
		}
	}
	var pending []string
	for id, r := range sb.routes {
		eff := d.applyLocked(sb, r, route.OwnerResumed{})
		if eff.StartPreparing {
			pending = append(pending, id)
		}
		if eff.Notify == route.NoticeReconnecting {
			d.cfg.Notifier.Reconnecting(d.ref(sb, id))
		}
	}
	d.persistAllocations(sb, changed)
	sb.mu.Unlock()
	for _, id := range pending {
		d.startPreparing(sb, id)
	}
}

// watchOwner stops driving the sandbox when its owner lease is lost.
func (d *Driver) watchOwner(sb *sandbox) {
	select {
	case <-sb.owner.Done():
	case <-sb.ctx.Done():
		return
	}
	sb.mu.Lock()
	released := sb.dropped // let go of (empty): the release closed Done
	sb.mu.Unlock()
	if released {
		return
	}
	d.Metrics.LeaseLosses.Add(1)
	// Persist the last observation with a guarded write: if another replica
	// took the sandbox the fence rejects it, which is how a paused replica
	// learns for certain that it is no longer the owner.
	// Copies taken under the lock: the tick goes on changing the allocations while
	// the write below encodes them.
	sb.mu.Lock()
	allocs := make([]*store.KeyAllocation, 0, len(sb.keyAllocations))
	for _, s := range sb.keyAllocations {
		c := *s
		allocs = append(allocs, &c)
	}
	sb.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	err := store.PutKeyAllocations(ctx, sb.owner, sb.id, allocs)
	cancel()
	if err != nil {
		d.staleWrite(sb, err)
	}
	d.drop(sb, fmt.Errorf("%w: owner lease lost (%w)", ErrOwnedElsewhere, sb.owner.Err()))
}

func (d *Driver) staleWrite(sb *sandbox, err error) {
	if sb.ctx.Err() != nil {
		// Dropped (shutdown, lost lease): the write of a goroutine that was
		// still finishing fails by design, and the sandbox is no longer ours.
		d.log.Debug("sandbox state write after it was dropped", "sandbox", sb.id, "err", err)
		return
	}
	if ownership.IsStale(err) {
		d.Metrics.StaleTokenRejections.Add(1)
		d.log.Warn("fenced write rejected: stale fencing token, another replica owns the sandbox", "sandbox", sb.id, "token", sb.owner.Token())
		go d.drop(sb, fmt.Errorf("%w: stale fencing token", ErrOwnedElsewhere))
		return
	}
	d.log.Warn("sandbox state write failed", "sandbox", sb.id, "err", err)
}

// drop stops driving sb: wrapper streams close for why (the wrappers
// reconnect to the new owner) and the reconciler forgets the sandbox.
func (d *Driver) drop(sb *sandbox, why error) {
	d.mu.Lock()
	if d.sandboxes[sb.id] == sb {
		delete(d.sandboxes, sb.id)
	}
	d.mu.Unlock()
	sb.mu.Lock()
	if sb.dropped {
		sb.mu.Unlock()
		return
	}
	sb.dropped = true
	for _, c := range sb.conns {
		c.close(why)
	}
	sb.mu.Unlock()
	d.cfg.Wrappers.Forget(sb.id)
	sb.stop()
	d.log.Info("stopped driving sandbox", "sandbox", sb.id, "why", why.Error())
}

func (d *Driver) dropAll() {
	for _, sb := range d.owned() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = sb.owner.Release(ctx)
		cancel()
		d.drop(sb, ErrShuttingDown)
	}
}

func (d *Driver) ref(sb *sandbox, sessionID string) RouteRef {
	return RouteRef{SessionID: sessionID, SandboxID: sb.id, AllocationID: sb.allocationID, FenceToken: sb.owner.Token()}
}

// persist helpers run under sb.mu.
func (d *Driver) persistRoute(sb *sandbox, r *store.Route) {
	r.Updated = d.cfg.Now()
	if err := store.PutRoute(sb.ctx, sb.owner, sb.id, r); err != nil {
		d.staleWrite(sb, err)
	}
}

func (d *Driver) persistAllocations(sb *sandbox, allocs []*store.KeyAllocation) {
	if err := store.PutKeyAllocations(sb.ctx, sb.owner, sb.id, allocs); err != nil {
		d.staleWrite(sb, err)
	}
}

func (d *Driver) persistScope(sb *sandbox, sc *scope.Scope) {
	if err := store.PutScope(sb.ctx, sb.owner, sc); err != nil {
		d.staleWrite(sb, err)
	}
}

func newID(prefix string) string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func digest(secret string) []byte {
	s := sha256.Sum256([]byte(secret))
	return s[:]
}

// launch starts a wrapper for the runtime key with markers m. The launch
// credential is recorded as a digest before the process exists, and reaches
// the wrapper through the provider (an inherited pipe, or a pooled
// wrapper's claim), never environ or argv.
func (d *Driver) launch(sb *sandbox, key, directory string, agent store.Agent) reconciler.LaunchFunc {
	return func(ctx context.Context, m provider.Markers) error {
		// The runtime key's wrapper runs the agent of the route that
		// launched it; later routes asking for another fail agent_mismatch.
		spec, err := d.cfg.Agents.Resolve(agent.Profile, agent.Model)
		if err != nil {
			return err
		}
		raw := make([]byte, 32)
		if _, err := rand.Read(raw); err != nil {
			return err
		}
		cred := "aplc_" + base64.RawURLEncoding.EncodeToString(raw)
		sb.mu.Lock()
		w := &store.Wrapper{Instance: m.InstanceID, RuntimeKey: key, Allocation: sb.allocationID,
			Generation: m.Generation, FenceToken: sb.owner.Token(), CredDigest: digest(cred)}
		if err := store.PutWrapper(ctx, sb.owner, sb.id, w); err != nil {
			sb.mu.Unlock()
			d.staleWrite(sb, err)
			return err
		}
		sb.wrappers[m.InstanceID] = w
		slot := sb.keyAllocations[key]
		if slot == nil {
			slot = &store.KeyAllocation{RuntimeKey: key, Directory: directory}
			sb.keyAllocations[key] = slot
		}
		slot.Directory = directory
		slot.Alloc = allocation.Apply(d.cfg.Timers, allocation.Allocation{}, allocation.Launched{Now: d.cfg.Now(), Instance: m.InstanceID})
		d.persistAllocations(sb, []*store.KeyAllocation{slot})
		alloc := sb.allocationID
		token := sb.owner.Token()
		if sb.launching == nil {
			sb.launching = map[string]int{}
		}
		sb.launching[key]++
		sb.mu.Unlock()
		defer func() {
			sb.mu.Lock()
			if sb.launching[key]--; sb.launching[key] <= 0 {
				delete(sb.launching, key)
			}
			sb.mu.Unlock()
		}()

		ls := d.wrapperShape(spec, directory)
		ls.Markers, ls.Identity = m, &provider.Identity{Allocation: alloc, FenceToken: token, Credential: cred}
		_, err = d.cfg.Provider.Launch(ctx, ls)
		if err != nil {
			// No wrapper is starting: a slot left "starting" would make the
			// next preparation wait for a Hello that never comes.
			sb.mu.Lock()
			if s := sb.keyAllocations[key]; s != nil && s.Alloc.Instance == m.InstanceID && s.Alloc.Phase == allocation.Starting {
				s.Alloc = allocation.Allocation{Phase: allocation.Stopped, Reason: "launch_failed"}
				d.persistAllocations(sb, []*store.KeyAllocation{s})
			}
			sb.mu.Unlock()
		}
		return err
	}
}

// wrapperShape is the launch of a wrapper running spec's agent for
// directory, without its markers and identity: what a launch shares with
// the pooled wrappers of its agent (DESIGN.md 3.8).
func (d *Driver) wrapperShape(spec agents.Spec, directory string) provider.LaunchSpec {
	args := append([]string{}, d.cfg.WrapperCommand[1:]...)
	args = append(args,
		"--control-addr", strings.Join(d.cfg.ControlAddrs, ","),
		"--heartbeat", d.cfg.Timers.Heartbeat.String(),
		"--reconnect-window", d.cfg.Timers.ReconnectWindow.String(),
	)
	if spec.Protocol != agents.ProtocolJSONL || spec.Profile != agents.Scripted {
		args = append(args, "--runtime-spec", spec.Encode())
	}
	return provider.LaunchSpec{Path: d.cfg.WrapperCommand[0], Args: args, Workspace: directory}
}

// PoolShape is the launch a warm pool of profile (its default model) keeps
// ready for routes at directory; an agent that is not installed answers
// agents.ErrUnavailable.
func (d *Driver) PoolShape(profile, directory string) (provider.LaunchSpec, error) {
	spec, err := d.cfg.Agents.Resolve(profile, "")
	if err != nil {
		return provider.LaunchSpec{}, err
	}
	return d.wrapperShape(spec, directory), nil
}

// helloAck builds the ack for a contract.
func (d *Driver) helloAck(c scope.Contract) HelloAck {
	return HelloAck{Heartbeat: d.cfg.Timers.Heartbeat, ReconnectWindow: d.cfg.Timers.ReconnectWindow, Contract: c}
}

func constantTimeEqual(a, b []byte) bool { return subtle.ConstantTimeCompare(a, b) == 1 }
