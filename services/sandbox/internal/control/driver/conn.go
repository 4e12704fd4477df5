package driver

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// HelloResult is the answer to a Hello: a Conn to serve, or a Shutdown
// frame to send before closing the stream.
type HelloResult struct {
	Conn     *Conn
	Ack      HelloAck
	Shutdown *Shutdown
}

// Hello authenticates a wrapper: its allocation must be current, its launch
// credential must match the digest stored for its instance (constant-time),
// its fence token must not be older than the one it was launched under nor
// newer than the owner's, and it must still be its runtime key's wrapper.
func (d *Driver) Hello(ctx context.Context, h Hello) (HelloResult, error) {
	if d.closing.Load() {
		return HelloResult{}, ErrShuttingDown
	}
	if res, err := d.allocationCurrent(ctx, h); err != nil || res.Shutdown != nil {
		return res, err
	}
	sb, err := d.own(ctx, h.SandboxID)
	if err != nil {
		return HelloResult{}, err
	}
	sb.mu.Lock()
	w, slot, reason, detail := d.authenticateLocked(sb, h)
	if w == nil {
		sb.mu.Unlock()
		return d.rejectHello(sb, h, reason, detail), nil
	}
	contract, refused, detail := d.negotiateLocked(sb, h, w.RuntimeKey, slot)
	if refused != nil {
		sb.mu.Unlock()
		refused()
		return d.rejectHello(sb, h, StopRequested, detail), nil
	}
	c, resumed, prepare, retire := d.connectLocked(sb, h, w, slot, contract)
	sb.mu.Unlock()
	if !retire {
		close(c.retired)
	}
	_ = d.cfg.Wrappers.StartupVerified(ctx, sb.id, c.RuntimeKey, c.Instance)
	for _, id := range resumed {
		sb.mu.Lock()
		r := sb.routes[id] // nil when a ReleaseRoute took it since sb.mu was released
		rsid := ""
		if r != nil {
			rsid = r.RuntimeSessionID
		}
		sb.mu.Unlock()
		if r != nil {
			d.cfg.Notifier.Ready(d.ref(sb, id), rsid, c.Instance)
		}
	}
	d.resendHandle(sb, c, resumed)
	if len(prepare) > 0 || retire {
		go d.reprepare(sb, c, slot.Directory, sb.owner.Token(), retire, prepare)
	}
	d.log.Info("wrapper connected", "sandbox", sb.id, "runtime_key", c.RuntimeKey, "instance", c.Instance, "contract", string(contract))
	return HelloResult{Conn: c, Ack: d.helloAck(contract)}, nil
}

// allocationCurrent refuses a Hello for a sandbox this replica does not own
// whose stored allocation is not the Hello's: an unauthenticated caller
// must not make this replica take (and index) a sandbox.
func (d *Driver) allocationCurrent(ctx context.Context, h Hello) (HelloResult, error) {
	d.mu.Lock()
	_, owned := d.sandboxes[h.SandboxID]
	d.mu.Unlock()
	if owned {
		return HelloResult{}, nil
	}
	alloc, err := store.AllocationID(ctx, d.cfg.Redis, h.SandboxID)
	if err != nil {
		return HelloResult{}, err
	}
	if alloc == "" || alloc != h.AllocationID {
		return HelloResult{Shutdown: &Shutdown{Reason: StaleAllocation, Detail: "the allocation is not current"}}, nil
	}
	return HelloResult{}, nil
}

func (d *Driver) rejectHello(sb *sandbox, h Hello, r ShutdownReason, detail string) HelloResult {
	d.log.Warn("wrapper hello rejected", "sandbox", sb.id, "instance", h.InstanceID, "reason", string(r))
	return HelloResult{Shutdown: &Shutdown{Reason: r, Detail: detail}}
}

// authenticateLocked checks the Hello against the sandbox's records: the
// wrapper and its slot, or nil and why the stream is refused.
func (d *Driver) authenticateLocked(sb *sandbox, h Hello) (*store.Wrapper, *store.KeyAllocation, ShutdownReason, string) {
	if sb.allocationID == "" || h.AllocationID != sb.allocationID {
		return nil, nil, StaleAllocation, "the allocation is not current"
	}
	w := sb.wrappers[h.InstanceID]
	got := digest(h.LaunchCredential)
	var want []byte
	if w != nil {
		want = w.CredDigest
	} else {
		want = make([]byte, len(got)) // compare anyway: same work for unknown instances
	}
	if !constantTimeEqual(got, want) || w == nil || w.Allocation != sb.allocationID ||
		w.RuntimeKey != h.RuntimeKey || w.Generation != h.Generation {
		return nil, nil, BadCredential, "the launch credential did not verify"
	}
	if h.FenceToken < w.FenceToken || h.FenceToken > sb.owner.Token() {
		return nil, nil, StaleFence, "the fencing token is stale"
	}
	slot := sb.keyAllocations[w.RuntimeKey]
	if slot == nil || slot.Alloc.Instance != w.Instance || !slot.Alloc.Live() {
		return nil, nil, LeaseLost, "another wrapper owns the runtime key"
	}
	return w, slot, "", ""
}

// negotiateLocked settles the runtime contract of the wrapper's directory.
// A wrapper that cannot serve it goes: refused is then what to do once
// sb.mu is released, and detail the Shutdown's.
func (d *Driver) negotiateLocked(sb *sandbox, h Hello, key string, slot *store.KeyAllocation) (contract scope.Contract, refused func(), detail string) {
	now := d.cfg.Now()
	sc := sb.scopeLocked(slot.Directory)
	contract, pin, err := scope.Negotiate(sc.Contract, scope.Offered(h.Capabilities, h.ProtocolVersion))
	if err != nil {
		slot.Alloc = allocation.Apply(d.cfg.Timers, slot.Alloc, allocation.Stop{Now: now, Reason: "runtime_contract_downgrade"})
		d.persistAllocations(sb, []*store.KeyAllocation{slot})
		failed := sb.routesOfLocked(key, store.RoutePreparing)
		return "", func() {
			for _, id := range failed {
				d.failRoute(sb, id, "runtime_contract_downgrade", false)
			}
			go d.stopKey(sb, key, "runtime_contract_downgrade")
		}, "RUNTIME_CONTRACT_DOWNGRADE: the directory is pinned to the worktree contract"
	}
	if pin {
		sc.Contract = contract
		d.persistScope(sb, sc)
	}
	if contract == scope.PerSession && key == slot.Directory {
		// The directory's first wrapper was keyed by directory before the
		// contract was known; under per_session each session gets its own
		// runtime key, so this wrapper goes and the routes are prepared again.
		slot.Alloc = allocation.Apply(d.cfg.Timers, slot.Alloc, allocation.Stop{Now: now, Reason: "per_session_contract"})
		d.persistAllocations(sb, []*store.KeyAllocation{slot})
		pending := sb.routesOfLocked(key, store.RoutePreparing)
		return "", func() {
			go func() {
				d.stopKey(sb, key, "per_session_contract")
				for _, id := range pending {
					d.startPreparing(sb, id)
				}
			}()
		}, "the directory uses the per_session contract"
	}
	return contract, nil, ""
}

// connectLocked makes the wrapper its runtime key's connection and applies
// its Hello to the key's routes: the ones it resumed, the ones to prepare on
// it, and whether the scope's accepted handles are retired first.
func (d *Driver) connectLocked(sb *sandbox, h Hello, w *store.Wrapper, slot *store.KeyAllocation, contract scope.Contract) (c *Conn, resumed, prepare []string, retire bool) {
	key := w.RuntimeKey
	// The first Hello of a launched instance is a wrapper (re)start: nothing
	// the scope accepted before reached this runtime, and it may be a
	// handle of an older owner fence, which no joiner could adopt.
	fresh := slot.Alloc.Phase == allocation.Starting
	slot.Alloc = allocation.Apply(d.cfg.Timers, slot.Alloc, allocation.Hello{Now: d.cfg.Now(), Instance: w.Instance})
	d.persistAllocations(sb, []*store.KeyAllocation{slot})
	if old := sb.conns[key]; old != nil {
		old.close(ErrStreamReplaced)
	}
	c = &Conn{SandboxID: sb.id, RuntimeKey: key, Instance: w.Instance, Contract: contract,
		Send: make(chan ToWrapper, 1024), Closed: make(chan struct{}), retired: make(chan struct{})}
	sb.conns[key] = c
	active := map[string]string{}
	for _, a := range h.Routes {
		active[a.SessionID] = a.RuntimeSessionID
	}
	restarted := false
	for id, r := range sb.routes {
		if r.RuntimeKey != key {
			continue
		}
		rsid, kept := active[id]
		eff := d.applyLocked(sb, r, route.WrapperHello{RuntimeKey: key, Instance: w.Instance, Kept: kept, RuntimeSessionID: rsid})
		if eff.DropHandle {
			delete(sb.handles, id)
		}
		restarted = restarted || eff.Restarted
		switch {
		case eff.Notify == route.NoticeReady:
			resumed = append(resumed, id)
		case eff.SendPrepare:
			prepare = append(prepare, id)
		}
	}
	return c, resumed, prepare, contract == scope.Worktree && (restarted || fresh)
}

// reprepare sends PrepareRoute for routes a (new) wrapper must open. After a
// wrapper restart under the worktree contract (a fresh instance's first
// Hello, or routes that another instance served) the scope's accepted
// handles are retired first (DESIGN.md 5: the old runtime may have leaked
// them, and an older owner fence's handle would refuse every joiner), so the
// first mint issues a fresh canonical handle and its siblings adopt it. No
// mint for this wrapper runs before (sendPrepare waits for c.retired).
func (d *Driver) reprepare(sb *sandbox, c *Conn, dir string, fence uint64, retire bool, ids []string) {
	if retire && d.cfg.Credentials != nil {
		ctx, cancel := context.WithTimeout(sb.ctx, 10*time.Second)
		err := d.cfg.Credentials.RetireScope(ctx, ScopeRef{SandboxID: sb.id, Directory: dir}, fence)
		cancel()
		if err != nil {
			d.log.Warn("scope retire failed", "sandbox", sb.id, "code", errCode(err))
		}
	}
	if retire {
		close(c.retired)
	}
	for _, id := range ids {
		d.sendPrepare(sb, c, id)
	}
}

func (sb *sandbox) routesOfLocked(key string, states ...route.State) []string {
	var ids []string
	for id, r := range sb.routes {
		if r.RuntimeKey != key {
			continue
		}
		for _, s := range states {
			if r.State == s {
				ids = append(ids, id)
			}
		}
	}
	return ids
}

// stopKey requests a stop of every wrapper of the runtime key.
func (d *Driver) stopKey(sb *sandbox, key, reason string) {
	sb.mu.Lock()
	c := sb.conns[key]
	sb.mu.Unlock()
	if c != nil {
		c.send(stopRequested(reason))
	}
	if err := d.cfg.Wrappers.RequestStop(sb.ctx, sb.id, key, reason); err != nil {
		d.log.Warn("request stop failed", "sandbox", sb.id, "runtime_key", key, "err", err)
	}
}

// Frame applies one frame of an authenticated wrapper.
func (d *Driver) Frame(c *Conn, f FromWrapper) {
	d.mu.Lock()
	sb := d.sandboxes[c.SandboxID]
	d.mu.Unlock()
	if sb == nil {
		c.close(ErrOwnedElsewhere) // dropped since the Hello
		return
	}
	now := d.cfg.Now()
	switch x := f.(type) {
	case Heartbeat:
		sb.mu.Lock()
		if s := sb.keyAllocations[c.RuntimeKey]; s != nil && s.Alloc.Instance == c.Instance {
			s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Heartbeat{Now: now})
			if len(x.BusySessionIDs) > 0 {
				s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Activity{Now: now})
			}
		}
		sb.mu.Unlock()
	case Progress:
		if d.routeOf(sb, c, x.SessionID) {
			d.cfg.Notifier.Progress(d.ref(sb, x.SessionID), x.Step)
		}
	case RouteReady:
		d.routeReady(sb, c, x, now)
	case WorktreeResult:
		d.worktreeResult(c, x)
	case RouteFailed:
		if d.routeOf(sb, c, x.SessionID) && x.Reason == ReasonWorkspaceNoSpace {
			// A clone that filled the disk is ENOSPC evidence (DESIGN.md 3.4).
			go d.admissionFailed(sb, x.SessionID, provider.ErrENOSPC)
		} else if d.routeOf(sb, c, x.SessionID) {
			d.failRoute(sb, x.SessionID, x.Reason, x.Retryable)
		}
	case RuntimeEvents:
		if d.routeOf(sb, c, x.SessionID) && len(x.Events) > 0 {
			d.cfg.Notifier.Events(d.ref(sb, x.SessionID), x.Events)
		}
	case Outcome:
		if d.routeOf(sb, c, x.SessionID) {
			d.cfg.Notifier.Outcome(d.ref(sb, x.SessionID), x.Outcome)
			d.activity(sb, c.RuntimeKey)
			_ = d.cfg.Wrappers.RetainWarm(sb.ctx, sb.id, c.RuntimeKey, c.Instance, now.Add(keepWarm))
		}
	}
}

// routeReady applies a wrapper's RouteReady: the route joins its scope and
// the session service learns it is ready.
func (d *Driver) routeReady(sb *sandbox, c *Conn, x RouteReady, now time.Time) {
	sb.mu.Lock()
	r := sb.routes[x.SessionID]
	if r == nil {
		sb.mu.Unlock()
		return
	}
	eff := d.applyLocked(sb, r, route.RouteReady{RuntimeKey: c.RuntimeKey, Instance: c.Instance, RuntimeSessionID: x.RuntimeSessionID})
	if !eff.JoinScope {
		sb.mu.Unlock()
		return
	}
	sc := sb.scopeLocked(r.Directory)
	sc.Join(x.SessionID, r.RuntimeSessionID, r.CredentialClass)
	d.persistScope(sb, sc)
	if s := sb.keyAllocations[c.RuntimeKey]; s != nil {
		s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Activity{Now: now})
	}
	sb.mu.Unlock()
	d.cfg.Notifier.Ready(d.ref(sb, x.SessionID), x.RuntimeSessionID, c.Instance)
}

// keepWarm is how long a wrapper is kept after a turn (DESIGN.md 3.2).
const keepWarm = 5 * time.Minute

func (d *Driver) routeOf(sb *sandbox, c *Conn, sessionID string) bool {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	r := sb.routes[sessionID]
	return r != nil && r.RuntimeKey == c.RuntimeKey && r.State != store.RouteReleased
}

// Disconnected records that a wrapper's stream ended.
func (d *Driver) Disconnected(c *Conn) {
	c.close(nil) // the stream is over; nobody reads the reason
	d.mu.Lock()
	sb := d.sandboxes[c.SandboxID]
	d.mu.Unlock()
	if sb == nil {
		return
	}
	sb.mu.Lock()
	if sb.conns[c.RuntimeKey] != c {
		sb.mu.Unlock()
		return
	}
	delete(sb.conns, c.RuntimeKey)
	s := sb.keyAllocations[c.RuntimeKey]
	if s == nil {
		sb.mu.Unlock()
		return
	}
	s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.StreamClosed{Now: d.cfg.Now(), Instance: c.Instance})
	d.persistAllocations(sb, []*store.KeyAllocation{s})
	ids := d.reconnectingLocked(sb, c.RuntimeKey)
	sb.mu.Unlock()
	for _, id := range ids {
		d.cfg.Notifier.Reconnecting(d.ref(sb, id))
	}
}

func (d *Driver) reconnectingLocked(sb *sandbox, key string) []string {
	var ids []string
	for id, r := range sb.routes {
		if eff := d.applyLocked(sb, r, route.StreamClosed{RuntimeKey: key}); eff.Notify == route.NoticeReconnecting {
			ids = append(ids, id)
		}
	}
	return ids
}

// errCode names a credential-port failure for the log (never its text).
func errCode(err error) string {
	if ce := (*CredentialError)(nil); errors.As(err, &ce) {
		return ce.Code
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "DeadlineExceeded"
	}
	return "Unknown"
}
