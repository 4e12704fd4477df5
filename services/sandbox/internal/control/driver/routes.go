package driver

import (
	"context"
	"errors"
	"strings"
	"time"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/reconciler"
	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// RouteSpec is what Prepare asks for.
type RouteSpec struct {
	SessionID, SandboxID, Directory, RepoURL, UserID, OrgID, CredentialRef, CredentialClass string
	Agent                                                                                   store.Agent
	RepoRef, GitCredentialRef                                                               string
	RepoDepth                                                                               uint32
	Egress                                                                                  egresspolicy.Policy
	EgressVersion                                                                           uint64
	// Restart continues a route that failed resume_state_lost with a new
	// conversation (route.Prepare.Restart).
	Restart bool
}

// Prepare is idempotent and returns at once with the current route view,
// starting preparation when the route is not ready.
func (d *Driver) Prepare(ctx context.Context, spec RouteSpec) (store.Route, error) {
	resolved, err := d.cfg.Agents.Resolve(spec.Agent.Profile, spec.Agent.Model)
	if err != nil {
		return store.Route{}, err
	}
	spec.Agent.Profile, spec.Agent.Model = resolved.Profile, resolved.Model
	sb, err := d.own(ctx, spec.SandboxID)
	if err != nil {
		return store.Route{}, err
	}
	rememberRoute(ctx, spec.SandboxID, spec.SessionID)
	sb.mu.Lock()
	if sb.dropped {
		// Let go of (empty, or its lease lost) since own returned it: ask again.
		sb.mu.Unlock()
		return d.Prepare(ctx, spec)
	}
	r := sb.routes[spec.SessionID]
	var cur route.Route
	if r != nil {
		cur = r.Route
	}
	next, eff := route.Apply(cur, route.Prepare{Directory: spec.Directory, Restart: spec.Restart})
	if eff.Err != nil {
		sb.mu.Unlock()
		return store.Route{}, ErrDirectoryMoved
	}
	if !eff.Admit {
		// A live route is returned as it is.
		d.takeEgressLocked(sb, r, spec.Egress, spec.EgressVersion)
		view := *r
		preparing := sb.preparing[spec.SessionID]
		sb.mu.Unlock()
		if eff.StartPreparing && !preparing {
			d.startPreparing(sb, spec.SessionID)
		}
		return view, nil
	}
	sc := sb.scopeLocked(spec.Directory)
	if err := sc.Admit(spec.SessionID, spec.CredentialClass); err != nil {
		sb.mu.Unlock()
		return store.Route{}, err
	}
	next.Contract = sc.Contract
	r = &store.Route{
		SessionID: spec.SessionID, Route: next, RepoURL: spec.RepoURL, UserID: spec.UserID, OrgID: spec.OrgID,
		CredentialRef: spec.CredentialRef, CredentialClass: spec.CredentialClass, Agent: spec.Agent,
		RepoRef: spec.RepoRef, RepoDepth: spec.RepoDepth, GitCredentialRef: spec.GitCredentialRef,
		Egress: spec.Egress, EgressVersion: spec.EgressVersion,
	}
	sb.routes[spec.SessionID] = r
	d.persistRoute(sb, r)
	view := *r
	sb.mu.Unlock()
	d.startPreparing(sb, spec.SessionID)
	return view, nil
}

// applyLocked applies ev to route r (under sb.mu) and writes the record
// when the transition calls for it; the caller performs the other effects.
func (d *Driver) applyLocked(sb *sandbox, r *store.Route, ev route.Event) route.Effects {
	var eff route.Effects
	r.Route, eff = route.Apply(r.Route, ev)
	if eff.Persist {
		d.persistRoute(sb, r)
	}
	return eff
}

func (sb *sandbox) scopeLocked(dir string) *scope.Scope {
	sc := sb.scopes[dir]
	if sc == nil {
		sc = &scope.Scope{SandboxID: sb.id, Directory: dir}
		sb.scopes[dir] = sc
	}
	return sc
}

// startPreparing starts preparing a route in the background (once at a
// time). A start asked for while the route is being prepared is not lost:
// the running preparation looked at the sandbox before the event that asked (a Hello
// that pinned per_session and stopped the directory's wrapper), so it runs
// once more when it ends.
func (d *Driver) startPreparing(sb *sandbox, sessionID string) {
	sb.mu.Lock()
	if sb.dropped {
		sb.mu.Unlock()
		return
	}
	if sb.preparing[sessionID] {
		sb.prepareAgain[sessionID] = true
		sb.mu.Unlock()
		return
	}
	sb.preparing[sessionID] = true
	// Taken before preparing, so a stop that completes while prepare runs
	// (after its refusal) still wakes the retry.
	stopped := sb.stopSignal()
	sb.mu.Unlock()
	go func() {
		retry := d.prepare(sb, sessionID)
		sb.mu.Lock()
		delete(sb.preparing, sessionID)
		again := sb.prepareAgain[sessionID]
		delete(sb.prepareAgain, sessionID)
		sb.mu.Unlock()
		if again {
			d.startPreparing(sb, sessionID)
			return
		}
		if retry > 0 {
			// A refusal waits for the pending stop to end (event) or, as a
			// fallback, for its RetryAfter.
			t := time.NewTimer(retry)
			defer t.Stop()
			select {
			case <-sb.ctx.Done():
			case <-stopped:
				d.startPreparing(sb, sessionID)
			case <-t.C:
				d.startPreparing(sb, sessionID)
			}
		}
	}()
}

// prepare drives one route toward its wrapper; it returns a delay after which
// to try again (0: nothing more to do here, the wrapper's Hello continues).
func (d *Driver) prepare(sb *sandbox, sessionID string) time.Duration {
	ctx, span := tracer.Start(routeCtx(sb.ctx, sb.id, sessionID), "sandbox.prepare")
	defer span.End()
	key, dir, agent, retry, launch := d.beginPrepare(ctx, sb, sessionID)
	if !launch {
		return retry
	}
	d.cfg.Notifier.Progress(d.ref(sb, sessionID), progressStep("create_sandbox", "preparing the sandbox"))
	if !d.createSandbox(ctx, sb, sessionID, dir) {
		return 0
	}
	if !d.resumeState(ctx, sb, sessionID, key, dir) {
		return 0
	}
	d.cfg.Notifier.Progress(d.ref(sb, sessionID), progressStep("start_wrapper", "starting the wrapper"))
	dec, err := d.cfg.Wrappers.EnsureWrapper(ctx, sb.id, key, d.launch(sb, key, dir, agent))
	if err != nil {
		return d.ensureFailed(ctx, sb, sessionID, key, dec, err)
	}
	d.ensured(sb, sessionID, key, dir, dec)
	return 0
}

// resumeState runs before a route's runtime is launched again. A route a
// runtime served needs its workspace and the runtime's home (the agent's
// session store): when either is gone the route fails
// route.ReasonResumeStateLost rather than come back as an agent that
// silently forgot the conversation. A route restarting after that loss gets
// a fresh home when no other session routes to its runtime key, so the
// agent cannot load a conversation whose workspace is gone. It reports
// whether the launch goes on.
func (d *Driver) resumeState(ctx context.Context, sb *sandbox, sessionID, key, dir string) bool {
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil {
		sb.mu.Unlock()
		return false
	}
	if r.Restart {
		defer sb.mu.Unlock()
		for id, o := range sb.routes {
			if id != sessionID && o.RuntimeKey == key && o.Member() {
				return true // the home is the other sessions' too
			}
		}
		if err := d.cfg.Provider.Delete(ctx, sb.id, key, provider.DeleteHome); err != nil {
			d.log.Warn("restart: the old home was not removed", "sandbox", sb.id, "runtime_key", key, "err", err)
		}
		return true
	}
	served := r.Served
	sb.mu.Unlock()
	keeper, ok := d.cfg.Provider.(provider.StateKeeper)
	if !served || !ok {
		return true
	}
	kept, err := keeper.StateKept(ctx, sb.id, dir, key)
	if err != nil {
		// Never read as loss: the launch meets the same trouble and says so.
		d.log.Warn("resume: state not inspected", "sandbox", sb.id, "runtime_key", key, "err", err)
		return true
	}
	if kept {
		return true
	}
	d.log.Warn("resume: the workspace or the runtime's home is gone", "sandbox", sb.id, "session", sessionID, "runtime_key", key)
	d.failRoute(sb, sessionID, route.ReasonResumeStateLost, false)
	return false
}

// beginPrepare keys the route and reports whether a wrapper must be
// brought up for it (launch), with the key, directory and agent it runs;
// otherwise the route is on its way (its wrapper is connected or coming)
// or retry says when to try again.
func (d *Driver) beginPrepare(ctx context.Context, sb *sandbox, sessionID string) (key, dir string, agent store.Agent, retry time.Duration, launch bool) {
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil || r.State != store.RoutePreparing || sb.dropped {
		sb.mu.Unlock()
		return "", "", store.Agent{}, 0, false
	}
	if sb.allocationID == "" {
		sb.allocationID = newID("alloc_")
		if err := store.PutMeta(ctx, sb.owner, sb.id, sb.allocationID); err != nil {
			sb.mu.Unlock()
			d.staleWrite(sb, err)
			return "", "", store.Agent{}, 0, false
		}
	}
	sc := sb.scopeLocked(r.Directory)
	key = scope.RuntimeKey(sc.Contract, r.Directory, sessionID)
	// Keyed is written with the step below (or by sendPrepare's write).
	r.Route, _ = route.Apply(r.Route, route.Keyed{RuntimeKey: key, Contract: sc.Contract})
	if sb.recovering[key] != nil {
		// Nothing is made for a runtime key whose wrappers are being
		// stopped by its recovery; its end prepares the route again.
		d.applyLocked(sb, r, route.StepReached{Step: "wait_for_recovery"})
		sb.mu.Unlock()
		return "", "", store.Agent{}, time.Second, false
	}
	if c := sb.conns[key]; c != nil {
		d.persistRoute(sb, r)
		sb.mu.Unlock()
		d.sendPrepare(sb, c, sessionID)
		return "", "", store.Agent{}, 0, false
	}
	if s := sb.keyAllocations[key]; s != nil && (s.Alloc.Phase == allocation.Starting || s.Alloc.Phase == allocation.Disconnected) {
		// Its wrapper is coming (back); the Hello sends the route.
		d.applyLocked(sb, r, route.StepReached{Step: route.StepWaitForWrapper})
		sb.mu.Unlock()
		return "", "", store.Agent{}, 0, false
	}
	d.applyLocked(sb, r, route.StepReached{Step: route.StepCreateSandbox})
	dir, agent = r.Directory, r.Agent
	sb.mu.Unlock()
	return key, dir, agent, 0, true
}

// createSandbox makes the sandbox and admits the directory's workspace; on
// failure the route has failed (or its runtime key recovers).
func (d *Driver) createSandbox(ctx context.Context, sb *sandbox, sessionID, dir string) bool {
	cctx, cancel := context.WithTimeout(ctx, d.cfg.Timers.Create)
	err := d.cfg.Provider.Create(cctx, sb.id)
	cancel()
	if err != nil {
		if provider.StartsRecovery(err) {
			d.admissionFailed(sb, sessionID, err) // the key's recovery, as for a workspace that cannot be made
			return false
		}
		d.failRoute(sb, sessionID, "sandbox_create_failed", true)
		return false
	}
	if d.cfg.Admission != nil {
		if err := d.cfg.Admission.Admit(ctx, sb.id, dir, d.inUse(sb)); err != nil {
			d.admissionFailed(sb, sessionID, err)
			return false
		}
	}
	return true
}

// inUse lists the directories and runtime keys of the sandbox's stored
// routes but released ones: what capacity cleanup must keep.
func (d *Driver) inUse(sb *sandbox) []string {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	var out []string
	for _, r := range sb.routes {
		if r.State != store.RouteReleased {
			out = append(out, r.Directory, r.RuntimeKey)
		}
	}
	return out
}

// ensureFailed applies an EnsureWrapper error; it returns when to try again.
func (d *Driver) ensureFailed(ctx context.Context, sb *sandbox, sessionID, key string, dec reconciler.Decision, err error) time.Duration {
	switch {
	case errors.Is(err, reconciler.ErrRefused):
		d.setStep(sb, sessionID, route.StepWaitForCleanup)
		return max(dec.RetryAfter, time.Second)
	case errors.Is(err, provider.ErrCapacityRejected):
		d.failRoute(sb, sessionID, "capacity_rejected", true)
		return 0
	case errors.Is(err, provider.ErrDiskQuota):
		d.failRoute(sb, sessionID, provider.ReasonDiskQuota, false)
		return 0
	case errors.Is(err, provider.ErrDirectoryReserved):
		d.log.Warn("route directory cannot be bound in the sandbox", "sandbox", sb.id, "runtime_key", key, "err", err)
		d.failRoute(sb, sessionID, provider.ReasonDirectoryReserved, false)
		return 0
	case provider.StartsRecovery(err):
		// The launch could not prepare the workspace (ENOSPC, an unwritable
		// tree): the route fails with a reason and its runtime key recovers
		// (DESIGN 3.4), rather than waiting for a cleanup that fixes nothing.
		d.admissionFailed(sb, sessionID, err)
		return 0
	}
	if ctx.Err() != nil {
		return 0
	}
	d.log.Warn("ensure wrapper failed", "sandbox", sb.id, "runtime_key", key, "err", err)
	d.setStep(sb, sessionID, route.StepWaitForCleanup)
	return time.Second
}

// ensured applies EnsureWrapper's decision: a reused wrapper gets the route
// (or is waited for), a launched one's Hello will.
func (d *Driver) ensured(sb *sandbox, sessionID, key, dir string, dec reconciler.Decision) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	switch dec.Action {
	case reconciler.Reused:
		s := sb.keyAllocations[key]
		if c := sb.conns[key]; c != nil {
			go d.sendPrepare(sb, c, sessionID)
		} else if s == nil || !s.Alloc.Live() {
			// The lease's wrapper runs but we have no allocation for it
			// (its stream never came): wait for its Hello.
			if s == nil {
				s = &store.KeyAllocation{RuntimeKey: key, Directory: dir}
				sb.keyAllocations[key] = s
			}
			s.Alloc = allocation.Apply(d.cfg.Timers, allocation.Allocation{}, allocation.Launched{Now: d.cfg.Now(), Instance: dec.Markers.InstanceID})
			d.persistAllocations(sb, []*store.KeyAllocation{s})
		}
	case reconciler.Launched:
		if r := sb.routes[sessionID]; r != nil {
			d.applyLocked(sb, r, route.StepReached{Step: route.StepWaitForWrapper})
		}
	}
}

// admissionFailed applies DESIGN.md 3.4: low capacity fails the route
// retryably and removes nothing; ENOSPC evidence (or a failed directory
// setup) fails the route and recovers its runtime key only (recovery.go:
// its wrappers stopped, then only what is recreatable removed, never a
// workspace with anything in it); unmeasurable capacity removes nothing.
func (d *Driver) admissionFailed(sb *sandbox, sessionID string, err error) {
	switch {
	case errors.Is(err, provider.ErrDiskQuota):
		d.log.Warn("sandbox over its disk quota", "sandbox", sb.id, "session", sessionID, "err", err)
		d.failRoute(sb, sessionID, provider.ReasonDiskQuota, false)
	case errors.Is(err, provider.ErrCapacityRejected):
		d.Metrics.CapacityRejections.Add(1)
		d.log.Warn("capacity rejected", "sandbox", sb.id, "session", sessionID, "err", err)
		d.failRoute(sb, sessionID, "capacity_rejected", true)
	case provider.StartsRecovery(err):
		d.beginRecovery(sb, sessionID, err)
		d.failRoute(sb, sessionID, "sandbox_recovering", true)
	default:
		d.log.Warn("capacity unmeasurable", "sandbox", sb.id, "err", err)
		d.failRoute(sb, sessionID, "capacity_unmeasurable", true)
	}
}

func (d *Driver) setStep(sb *sandbox, sessionID, step string) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if r := sb.routes[sessionID]; r != nil {
		d.applyLocked(sb, r, route.StepReached{Step: step})
	}
}

func (d *Driver) failRoute(sb *sandbox, sessionID, reason string, retryable bool) {
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil {
		sb.mu.Unlock()
		return
	}
	eff := d.applyLocked(sb, r, route.RouteFailed{Reason: reason, Retryable: retryable})
	sb.mu.Unlock()
	if eff.Notify == route.NoticeFailed {
		d.cfg.Notifier.Failed(d.ref(sb, sessionID), eff.Reason, eff.Retryable)
	}
}

// sendPrepare mints or adopts the route's handle (when a credential service
// is configured) and sends PrepareRoute on the wrapper's stream.
func (d *Driver) sendPrepare(sb *sandbox, c *Conn, sessionID string) {
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil || sb.dropped {
		sb.mu.Unlock()
		return
	}
	// Mint under the contract the serving wrapper's Hello negotiated, never
	// the one the route saw when it was keyed: a route keyed before the
	// directory's first Hello carries no contract, and minting it as
	// per_session would put a per-session handle into a worktree runtime.
	// The sandbox names the runtime session (if the route has none) before
	// the runtime starts: the credential grant registers it as the member's
	// ingest root, and the runtime is told to use it
	// (PrepareRoute.runtime_session_id).
	d.applyLocked(sb, r, route.PrepareSent{Contract: c.Contract, RuntimeSessionID: newID("rs_")})
	spec, alloc, token := *r, sb.allocationID, sb.owner.Token()
	sb.mu.Unlock()
	handle := ""
	if d.cfg.Credentials != nil {
		select {
		case <-c.retired:
		case <-c.Closed:
			return // the wrapper's next stream prepares the route again
		case <-sb.ctx.Done():
			return
		}
		h, adopted, err := d.mint(sb.ctx, sb.id, alloc, token, spec)
		if err != nil {
			d.log.Warn("handle mint failed", "sandbox", sb.id, "session", sessionID, "code", errCode(err))
			d.failRoute(sb, sessionID, "credential_unavailable", true)
			return
		}
		handle = h
		sb.mu.Lock()
		sb.handles[sessionID] = h
		var stale []string
		if !adopted && spec.Contract == scope.Worktree {
			// A fresh canonical handle (after a retirement) replaces the one
			// the other routes of this runtime hold.
			for id, o := range sb.routes {
				if id != sessionID && o.RuntimeKey == spec.RuntimeKey && o.State != store.RouteReleased && sb.handles[id] != "" && sb.handles[id] != h {
					stale = append(stale, id)
					sb.handles[id] = h
				}
			}
		}
		sb.mu.Unlock()
		if len(stale) > 0 {
			c.send(HandleUpdate{SessionIDs: stale, Handle: h})
		}
	}
	c.send(PrepareRoute{
		SessionID: sessionID, Directory: spec.Directory, RepoURL: spec.RepoURL, Handle: handle,
		ProxyURL: d.proxyURL(sb.id), Contract: spec.Contract, RuntimeSessionID: spec.RuntimeSessionID,
		Agent:   spec.Agent,
		RepoRef: spec.RepoRef, RepoDepth: spec.RepoDepth, CloneRepo: spec.RepoURL != "" && spec.GitCredentialRef != "",
		Traceparent: traceparent(routeCtx(sb.ctx, sb.id, sessionID)),
	})
}

// proxyURL is the sandbox's own proxy base: the proxy binds the sandbox in
// the URL (`<proxy>/s/<sandbox-id>`) and refuses a handle of another one.
func (d *Driver) proxyURL(sandboxID string) string {
	if d.cfg.ProxyURL == "" {
		return ""
	}
	return strings.TrimRight(d.cfg.ProxyURL, "/") + "/s/" + sandboxID
}

// mint asks the credential service for the route's handle (Credentials.Mint
// covers adoption too).
func (d *Driver) mint(ctx context.Context, sandboxID, alloc string, token uint64, r store.Route) (string, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return d.cfg.Credentials.Mint(ctx, mintOf(sandboxID, alloc, token, r))
}

// Message is one message to deliver.
type Message struct{ ID, Content string }

// Deliver writes messages to the route's wrapper; false means NOT_READY and
// nothing was written.
func (d *Driver) Deliver(ctx context.Context, sandboxID, sessionID string, msgs []Message) (bool, store.Route, error) {
	sb, err := d.ownStored(ctx, sandboxID)
	if err != nil {
		return false, store.Route{}, err
	}
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil || r.State == store.RouteReleased {
		sb.mu.Unlock()
		return false, store.Route{}, ErrRouteNotFound
	}
	view := *r // r changes under sb.mu: read only the copy from here on
	c := sb.conns[r.RuntimeKey]
	sb.mu.Unlock()
	// An owner lease past its deadline unconfirmed may have been granted to
	// another replica: deliver nothing until a renewal is confirmed.
	if view.State != store.RouteReady || c == nil || sb.owner.Unconfirmed() {
		return false, view, nil
	}
	l, err := d.cfg.Wrappers.Lease(ctx, sb.id, view.RuntimeKey)
	if err != nil || l.HoldsDelivery() || (l.State == lease.OwnsWrapper && l.Instance != c.Instance) {
		return false, view, nil
	}
	if !c.send(Delivery{SessionID: sessionID, Messages: msgs, Traceparent: traceparent(ctx)}) {
		return false, view, nil
	}
	_ = d.cfg.Wrappers.DeliveryAccepted(ctx, sb.id, view.RuntimeKey, c.Instance)
	d.activity(sb, view.RuntimeKey)
	return true, view, nil
}

func (d *Driver) activity(sb *sandbox, key string) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if s := sb.keyAllocations[key]; s != nil {
		s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Activity{Now: d.cfg.Now()})
	}
}

// Abort sends a best-effort abort; it reports whether a frame was written.
func (d *Driver) Abort(ctx context.Context, sandboxID, sessionID, messageID string) (bool, error) {
	sb, err := d.ownStored(ctx, sandboxID)
	if err != nil {
		return false, err
	}
	sb.mu.Lock()
	r := sb.routes[sessionID]
	var c *Conn
	if r != nil {
		c = sb.conns[r.RuntimeKey]
	}
	sb.mu.Unlock()
	if r == nil {
		return false, ErrRouteNotFound
	}
	if c == nil {
		return false, nil
	}
	return c.send(Abort{SessionID: sessionID, MessageID: messageID}), nil
}

// Release is the result of ReleaseRoute.
type Release struct {
	LastMember, AbsenceVerified bool
	// ExhaustedFinal: a session-delete release whose runtime key's lease is
	// exhausted and had its final observation (DESIGN.md 3.5): the deletion
	// may complete although absence is not verified; the lease stays
	// exhausted and tracked.
	ExhaustedFinal bool
	Lease          lease.State
	RetryAfter     time.Duration
}

// ReasonSessionDelete is the release reason of a session deletion, the only
// one the exhausted-lease exception applies to.
const ReasonSessionDelete = "session-delete"

// deletionCheck verifies a released runtime key: absence, or for a
// deletion also an exhausted lease after its final observation.
func (d *Driver) deletionCheck(ctx context.Context, sandboxID, key, reason string) (absent, exhaustedFinal bool, l lease.Lease, retry time.Duration, err error) {
	check := d.cfg.Wrappers.AbsenceVerified
	if reason == ReasonSessionDelete {
		check = d.cfg.Wrappers.DeletionAllowed
	}
	ok, retry, err := check(ctx, sandboxID, key)
	if err != nil {
		return false, false, lease.Lease{}, 0, err
	}
	if l, err = d.cfg.Wrappers.Lease(ctx, sandboxID, key); err != nil {
		return false, false, lease.Lease{}, 0, err
	}
	exhaustedFinal = ok && l.State != lease.None
	return ok && !exhaustedFinal, exhaustedFinal, l, retry, nil
}

// ReleaseRoute removes the session from its runtime key; the last member
// requests a stop and reports whether absence is verified. Repeating the call
// keeps reporting until it is.
func (d *Driver) ReleaseRoute(ctx context.Context, sandboxID, sessionID, reason string) (Release, error) {
	sb, err := d.own(ctx, sandboxID)
	if err != nil {
		return Release{}, err
	}
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil {
		sb.mu.Unlock()
		return d.releaseUnrouted(ctx, sb, sessionID, reason)
	}
	rel := d.releaseLocked(sb, r, sessionID, reason)
	sb.mu.Unlock()
	if rel.conn != nil && rel.first {
		rel.conn.send(ReleaseRoute{SessionID: sessionID})
	}
	if !d.releaseMember(ctx, sb, sessionID) {
		// The session is still a member of its scope for the credential
		// service: not released yet, whatever runs. Asked again on the next
		// call (the session's deletion reconciler) and by the tick.
		return Release{LastMember: rel.last, Lease: lease.OwnsWrapper, RetryAfter: time.Second}, nil
	}
	if !rel.last || rel.key == "" {
		d.forgetRoute(sb, sessionID)
		return Release{LastMember: rel.last, AbsenceVerified: true, Lease: lease.OwnsWrapper}, nil
	}
	if rel.first || d.stopNotRequested(ctx, sb.id, rel.key) {
		if rel.conn != nil {
			rel.conn.send(stopRequested(reason))
		}
		if err := d.cfg.Wrappers.RequestStop(ctx, sb.id, rel.key, reason); err != nil {
			d.log.Warn("request stop failed", "sandbox", sb.id, "runtime_key", rel.key, "err", err)
		}
	}
	return d.releaseLastMember(ctx, sb, sessionID, rel, reason), nil
}

// stopNotRequested reports whether the runtime key's wrapper still runs
// with no stop requested. A repeated release of the key's last member asks
// for the stop then: the first release returned before asking when its
// member release failed (the churn soak's deletions waited forever on
// wrappers nobody had asked to stop).
func (d *Driver) stopNotRequested(ctx context.Context, sandboxID, key string) bool {
	l, err := d.cfg.Wrappers.Lease(ctx, sandboxID, key)
	return err == nil && l.State == lease.OwnsWrapper
}

// routeRelease is what ReleaseRoute decided under the sandbox's lock.
type routeRelease struct {
	key, dir string
	conn     *Conn // the runtime key's connected wrapper, or nil
	last     bool  // no other member routes to the runtime key
	first    bool  // the first release of the route; a repeat only reports
}

// releaseLocked applies the release to the route (under sb.mu): the
// session leaves its worktree scope and drops its handle, and the first
// release of the key's last member stops the key's allocation.
func (d *Driver) releaseLocked(sb *sandbox, r *store.Route, sessionID, reason string) routeRelease {
	rel := routeRelease{key: r.RuntimeKey, dir: r.Directory, conn: sb.conns[r.RuntimeKey], last: true}
	for id, o := range sb.routes {
		if id != sessionID && o.RuntimeKey == rel.key && o.Member() {
			rel.last = false
		}
	}
	eff := d.applyLocked(sb, r, route.Release{Credentials: d.cfg.Credentials != nil})
	rel.first = eff.SendRelease
	if eff.LeaveScope {
		if sc := sb.scopes[rel.dir]; sc != nil {
			sc.Leave(sessionID)
			d.persistScope(sb, sc)
		}
	}
	if eff.DropHandle {
		delete(sb.handles, sessionID)
	}
	if rel.first && rel.last {
		if s := sb.keyAllocations[rel.key]; s != nil {
			s.Alloc = allocation.Apply(d.cfg.Timers, s.Alloc, allocation.Stop{Now: d.cfg.Now(), Reason: reason})
			d.persistAllocations(sb, []*store.KeyAllocation{s})
		}
	}
	return rel
}

// releaseLastMember checks, for the runtime key's last member, whether
// the key's wrapper is verifiably absent; once it is, the key's data are
// removed and the route and key forgotten. Inspection failure is never
// absence: the caller asks again after RetryAfter.
func (d *Driver) releaseLastMember(ctx context.Context, sb *sandbox, sessionID string, rel routeRelease, reason string) Release {
	key, dir := rel.key, rel.dir
	ok, exhausted, l, retry, err := d.deletionCheck(ctx, sb.id, key, reason)
	if err != nil {
		d.log.Warn("release: absence not checked", "sandbox", sb.id, "runtime_key", key, "err", err)
		return Release{LastMember: true, Lease: l.State, RetryAfter: time.Second}
	}
	if exhausted {
		d.log.Warn("deletion allowed on an exhausted wrapper lease after its final observation; the lease stays tracked",
			"sandbox", sb.id, "session", sessionID, "runtime_key", key)
	}
	if ok {
		if err := d.dropData(ctx, sb, sessionID, key, dir); err != nil {
			// Removing the data is part of "verified" (DESIGN.md 3.5): the
			// route stays released and the next call tries again.
			d.log.Warn("release: data of the runtime key not removed yet; retried", "sandbox", sb.id, "runtime_key", key, "err", err)
			return Release{LastMember: true, Lease: l.State, RetryAfter: max(retry, time.Second)}
		}
	}
	if ok || exhausted {
		d.forgetRoute(sb, sessionID)
	}
	if ok {
		d.forgetKey(ctx, sb, key, dir)
	}
	return Release{LastMember: true, AbsenceVerified: ok, ExhaustedFinal: exhausted, Lease: l.State, RetryAfter: max(retry, time.Second)}
}

// releaseMember carries out a released route's persisted member-release
// intent: CredentialService.ReleaseMember under the owner's token, cleared
// once it succeeded (a member the service no longer lists: nothing left to release). It reports
// whether nothing is pending any more.
func (d *Driver) releaseMember(ctx context.Context, sb *sandbox, sessionID string) bool {
	sb.mu.Lock()
	r := sb.routes[sessionID]
	if r == nil || r.State != store.RouteReleased || !r.MemberReleasePending || d.cfg.Credentials == nil {
		sb.mu.Unlock()
		return true
	}
	dir, token := r.Directory, sb.owner.Token()
	sb.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err := d.cfg.Credentials.ReleaseMember(cctx, ScopeRef{SandboxID: sb.id, Directory: dir}, sessionID, token)
	cancel()
	if err != nil {
		d.log.Warn("credential member release failed; retried", "sandbox", sb.id, "session", sessionID, "code", errCode(err))
		return false
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if r := sb.routes[sessionID]; r != nil {
		d.applyLocked(sb, r, route.MemberReleased{})
	}
	return true
}

// memberRetryEvery spaces the tick's retries of pending member releases.
const memberRetryEvery = 5 * time.Second

// retryMemberReleases retries, off the tick's goroutine and one round at a
// time, every pending member release of the sandbox: the persisted intent
// is carried out even when no deletion asks again (a release for a stop).
func (d *Driver) retryMemberReleases(sb *sandbox) {
	now := d.cfg.Now()
	sb.mu.Lock()
	if sb.memberRetrying || now.Before(sb.memberRetryAt) {
		sb.mu.Unlock()
		return
	}
	var ids []string
	for id, r := range sb.routes {
		if r.State == store.RouteReleased && r.MemberReleasePending {
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		sb.mu.Unlock()
		return
	}
	sb.memberRetrying, sb.memberRetryAt = true, now.Add(memberRetryEvery)
	sb.mu.Unlock()
	go func() {
		for _, id := range ids {
			d.releaseMember(sb.ctx, sb, id)
		}
		sb.mu.Lock()
		sb.memberRetrying = false
		sb.mu.Unlock()
	}()
}

// releaseUnrouted releases a session the sandbox holds no (parsable) route
// record of. That is no proof that nothing of it runs: the record may not
// parse, or a crash may have lost it while its wrapper lived on. It fails
// closed: absence is verified only when every runtime key that could be the
// session's has lease none and discovery absent — its per-session key, the
// directory of a scope that lists it, and every key no live route of
// another session holds. Those keys serve nobody else, so they are stopped.
func (d *Driver) releaseUnrouted(ctx context.Context, sb *sandbox, sessionID, reason string) (Release, error) {
	sb.mu.Lock()
	held := map[string]bool{}
	for id, o := range sb.routes {
		if id != sessionID && o.RuntimeKey != "" && o.Member() {
			held[o.RuntimeKey] = true
		}
	}
	candidates := map[string]bool{sessionID: true}
	for dir, sc := range sb.scopes {
		if _, ok := sc.Members[sessionID]; ok {
			candidates[dir] = true
			sc.Leave(sessionID)
			d.persistScope(sb, sc)
		}
	}
	for key := range sb.keyAllocations {
		candidates[key] = true
	}
	var keys []string
	conns := map[string]*Conn{}
	for key := range candidates {
		if !held[key] {
			keys = append(keys, key)
			if c := sb.conns[key]; c != nil {
				conns[key] = c
			}
		}
	}
	sb.mu.Unlock()
	rel := Release{LastMember: true, AbsenceVerified: true, Lease: lease.None}
	for _, key := range keys {
		ok, exhausted, l, retry, err := d.deletionCheck(ctx, sb.id, key, reason)
		if err != nil {
			return Release{}, err // inspection failure is never absence
		}
		if ok {
			continue
		}
		if exhausted {
			rel.ExhaustedFinal, rel.Lease = true, l.State
			continue
		}
		if l.State == lease.OwnsWrapper {
			if c := conns[key]; c != nil {
				c.send(stopRequested(reason))
			}
			if err := d.cfg.Wrappers.RequestStop(ctx, sb.id, key, reason); err != nil {
				return Release{}, err
			}
			if l, err = d.cfg.Wrappers.Lease(ctx, sb.id, key); err != nil {
				return Release{}, err
			}
		}
		d.log.Warn("release without a route record: a runtime key that may be the session's is not verified absent",
			"sandbox", sb.id, "session", sessionID, "runtime_key", key, "lease", string(l.State))
		rel.AbsenceVerified, rel.Lease = false, l.State
		rel.RetryAfter = max(rel.RetryAfter, retry, time.Second)
	}
	if !rel.AbsenceVerified {
		rel.ExhaustedFinal = false // another key still runs: nothing is allowed yet
	} else if rel.ExhaustedFinal {
		rel.AbsenceVerified = false // allowed by the exception, not verified
	}
	return rel, nil
}

// errOtherKeyStopping: another runtime key of the directory is still being
// stopped, so its workspace cannot be removed yet.
var errOtherKeyStopping = errors.New("another runtime key of the directory is still stopping")

// dropData removes what a released runtime key leaves once its wrapper is
// verified absent (DESIGN.md 3.5, "Nothing outlives its session"): the
// key's home and, when no other session of the sandbox is in the directory
// and no other runtime key of it runs, the directory's workspace and its
// wrappers' logs, so the directory's next session gets a fresh clone. Nothing
// is removed while a route of the key is there again or its wrapper is
// coming: the checks and the removal run under the sandbox's lock, which a
// preparation takes before it launches. An error means the data is not
// gone yet (the release is then not verified).
func (d *Driver) dropData(ctx context.Context, sb *sandbox, sessionID, key, dir string) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	for id, r := range sb.routes {
		if r.RuntimeKey == key && (r.State != store.RouteReleased || sb.preparing[id]) {
			return nil // the key serves a session again: its data is that session's
		}
	}
	if s := sb.keyAllocations[key]; s != nil && s.Alloc.Live() {
		return nil
	}
	if err := d.cfg.Provider.Delete(ctx, sb.id, key, provider.DeleteHome); err != nil {
		return err
	}
	for id, r := range sb.routes {
		if id != sessionID && r.Directory == dir && (r.State != store.RouteReleased || sb.preparing[id]) {
			return nil // a session of the sandbox still lives in the directory: it keeps it
		}
	}
	for k, s := range sb.keyAllocations {
		if k == key || s.Directory != dir {
			continue
		}
		if s.Alloc.Live() {
			return nil
		}
		if s.Alloc.Phase == allocation.Stopping {
			return errOtherKeyStopping
		}
	}
	return d.cfg.Provider.Delete(ctx, sb.id, dir, provider.DeleteWorkspace)
}

// keyForgetter drops the wrapper lease of a runtime key that is gone with
// its last session (the reconciler; test fakes may not).
type keyForgetter interface {
	ForgetKey(ctx context.Context, sandboxID, runtimeKey string) error
}

// forgetKey removes the records of a runtime key verified absent whose last
// route is forgotten: its slot, its wrappers' records, its wrapper lease
// and, when no session is left in the directory, the directory's scope, so
// a sandbox with no session left keeps no record of one. Nothing goes
// while a route of the key or the directory is back or its wrapper comes.
// Best effort: what stays is harmless and goes with the next release.
func (d *Driver) forgetKey(ctx context.Context, sb *sandbox, key, dir string) {
	sb.mu.Lock()
	for id, r := range sb.routes {
		if r.RuntimeKey == key || sb.preparing[id] {
			sb.mu.Unlock()
			return
		}
	}
	if s := sb.keyAllocations[key]; s != nil && s.Alloc.Live() {
		sb.mu.Unlock()
		return
	}
	var instances []string
	for id, w := range sb.wrappers {
		if w.RuntimeKey == key {
			instances = append(instances, id)
		}
	}
	scopeDir := ""
	if sc := sb.scopes[dir]; sc != nil && len(sc.Members) == 0 {
		scopeDir = dir
		for _, r := range sb.routes {
			if r.Directory == dir {
				scopeDir = ""
			}
		}
	}
	if err := store.ForgetKey(ctx, sb.owner, d.cfg.Redis, sb.id, key, instances, scopeDir); err != nil {
		sb.mu.Unlock()
		d.staleWrite(sb, err)
		return
	}
	delete(sb.keyAllocations, key)
	for _, id := range instances {
		delete(sb.wrappers, id)
	}
	if scopeDir != "" {
		delete(sb.scopes, scopeDir)
	}
	sb.mu.Unlock()
	if f, ok := d.cfg.Wrappers.(keyForgetter); ok {
		if err := f.ForgetKey(ctx, sb.id, key); err != nil {
			d.log.Warn("wrapper lease of a released runtime key not dropped", "sandbox", sb.id, "runtime_key", key, "err", err)
		}
	}
}

func (d *Driver) forgetRoute(sb *sandbox, sessionID string) {
	forgetRouteTrace(sb.id, sessionID)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	r := sb.routes[sessionID]
	if r == nil {
		return
	}
	if _, eff := route.Apply(r.Route, route.Forget{}); eff.Delete {
		delete(sb.routes, sessionID)
		if err := store.DeleteRoute(sb.ctx, sb.owner, d.cfg.Redis, sb.id, sessionID); err != nil {
			d.staleWrite(sb, err)
		}
	}
}

// Route returns a route's view (for Status).
func (d *Driver) Route(ctx context.Context, sandboxID, sessionID string) (store.Route, bool, error) {
	sb, err := d.ownStored(ctx, sandboxID)
	if errors.Is(err, ErrRouteNotFound) {
		return store.Route{}, false, nil
	}
	if err != nil {
		return store.Route{}, false, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if r := sb.routes[sessionID]; r != nil {
		return *r, true, nil
	}
	return store.Route{}, false, nil
}

// ResolveAgent resolves an agent profile and model (CheckAgent).
func (d *Driver) ResolveAgent(profile, model string) (agents.Spec, error) {
	return d.cfg.Agents.Resolve(profile, model)
}
