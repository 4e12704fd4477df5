package reconciler

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/leasestore"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Stop reasons the reconciler itself requests.
const (
	ReasonLaunchFailed = "launch_failed"
	ReasonMismatch     = "discovery_mismatch" // duplicates, wrong instance/generation, unmarked
	ReasonLeaked       = "leaked"             // a wrapper without a lease that owns it
	ReasonGone         = "wrapper_gone_but_present"
)

// minRetry bounds RetryAfter from below so callers never spin.
const minRetry = time.Second

// Reconciler drives wrapper leases. Build it with New.
type Reconciler struct {
	cfg   Config
	store *leasestore.Store
	log   *slog.Logger

	mu     sync.Mutex
	fences map[string]Fence       // adopted sandboxes
	keys   map[string]*sync.Mutex // one per sandbox/runtime key
	wake   chan struct{}
}

// New builds a Reconciler.
func New(cfg Config) *Reconciler {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Policy.MaxAttempts == 0 {
		cfg.Policy = lease.DefaultPolicy()
	}
	if cfg.TickEvery <= 0 {
		cfg.TickEvery = time.Second
	}
	if cfg.SweepEvery <= 0 {
		cfg.SweepEvery = time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Reconciler{
		cfg:    cfg,
		store:  leasestore.New(cfg.Redis, cfg.Now),
		log:    cfg.Logger,
		fences: map[string]Fence{},
		keys:   map[string]*sync.Mutex{},
		wake:   make(chan struct{}, 1),
	}
}

// Adopt starts reconciling sandboxID under its owner f (again with the
// new owner after re-acquiring) and runs a leak sweep. The fence stays adopted
// even if the sweep fails; the periodic sweep retries.
func (r *Reconciler) Adopt(ctx context.Context, sandboxID string, f Fence) error {
	if sandboxID == "" || f == nil || f.Resource() == "" || f.Token() == 0 {
		return fmt.Errorf("reconciler: adopt %q: empty sandbox, resource or token", sandboxID)
	}
	r.mu.Lock()
	r.fences[sandboxID] = f
	r.mu.Unlock()
	return r.Sweep(ctx, sandboxID)
}

// Forget stops reconciling sandboxID (its owner lease was lost).
func (r *Reconciler) Forget(sandboxID string) {
	r.mu.Lock()
	delete(r.fences, sandboxID)
	r.mu.Unlock()
}

func (r *Reconciler) fence(sandboxID string) (Fence, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f, ok := r.fences[sandboxID]
	if !ok {
		return nil, fmt.Errorf("%w: %s", ErrNotAdopted, sandboxID)
	}
	return f, nil
}

func (r *Reconciler) sandboxes() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, 0, len(r.fences))
	for id := range r.fences {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// lock serializes work on one runtime key in this process.
func (r *Reconciler) lock(sandboxID, runtimeKey string) func() {
	k := sandboxID + "\x00" + runtimeKey
	r.mu.Lock()
	m, ok := r.keys[k]
	if !ok {
		m = &sync.Mutex{}
		r.keys[k] = m
	}
	r.mu.Unlock()
	m.Lock()
	return m.Unlock
}

// keyRef is one runtime key of an adopted sandbox, with its fence.
type keyRef struct {
	sandbox, key string
	fence        Fence
}

func (r *Reconciler) ref(sandboxID, runtimeKey string) (keyRef, error) {
	f, err := r.fence(sandboxID)
	return keyRef{sandbox: sandboxID, key: runtimeKey, fence: f}, err
}

// open locks a runtime key and reads its lease; on success the caller
// defers unlock.
func (r *Reconciler) open(ctx context.Context, sandboxID, runtimeKey string) (k keyRef, e leasestore.Entry, unlock func(), err error) {
	if k, err = r.ref(sandboxID, runtimeKey); err != nil {
		return k, e, nil, err
	}
	unlock = r.lock(sandboxID, runtimeKey)
	if e, err = r.get(ctx, k); err != nil {
		unlock()
		return k, e, nil, err
	}
	return k, e, unlock, nil
}

func (r *Reconciler) get(ctx context.Context, k keyRef) (leasestore.Entry, error) {
	e, err := r.store.Get(ctx, k.fence.Resource(), k.key)
	if err == nil && e.Quarantined != nil {
		r.log.Error("wrapper lease quarantined", "sandbox", k.sandbox, "runtime_key", k.key, "err", e.Quarantined)
	}
	return e, err
}

// apply applies ev to the stored lease and persists the result if it
// changed. The caller holds the key lock.
func (r *Reconciler) apply(ctx context.Context, k keyRef, e leasestore.Entry, ev lease.Event) (leasestore.Entry, error) {
	next := lease.Apply(r.cfg.Policy, e.Lease, ev)
	if next == e.Lease && e.Quarantined == nil {
		return e, nil
	}
	out, err := r.store.Put(ctx, k.fence.Resource(), k.fence.Token(), k.key, e, next)
	if err == nil {
		r.cfg.Metrics.transition(k.sandbox, k.key, e.Lease, next, r.cfg.Now())
	}
	return out, err
}

// event applies one event under the key lock.
func (r *Reconciler) event(ctx context.Context, sandboxID, runtimeKey string, ev lease.Event) error {
	k, e, unlock, err := r.open(ctx, sandboxID, runtimeKey)
	if err != nil {
		return err
	}
	defer unlock()
	_, err = r.apply(ctx, k, e, ev)
	return err
}

// EnsureWrapper applies the launch-or-reuse rule of DESIGN.md 3.2: launch
// only from none with discovery absent (the owns_wrapper claim with a new
// generation is persisted before launch), reuse only from owns_wrapper when
// discovery finds exactly the lease's wrapper. Any other discovery requests
// a stop of the whole runtime key and refuses.
func (r *Reconciler) EnsureWrapper(ctx context.Context, sandboxID, runtimeKey string, launch LaunchFunc) (Decision, error) {
	k, e, unlock, err := r.open(ctx, sandboxID, runtimeKey)
	if err != nil {
		return Decision{}, err
	}
	defer unlock()
	if e.Lease.HoldsDelivery() {
		return r.refuse(e.Lease, "stop pending")
	}
	d := r.cfg.Provider.Discover(ctx, sandboxID, runtimeKey)
	if d.Kind == provider.InspectionFailed {
		return Decision{Action: Refused, RetryAfter: r.cfg.Policy.RetryDelays[0], Reason: "inspection failed"},
			fmt.Errorf("%w: %w", ErrInspectionFailed, d.Err)
	}
	now := r.cfg.Now()
	if e.Lease.State == lease.OwnsWrapper {
		if d.Kind == provider.Present && len(d.Observed) == 1 && matches(d.Observed[0], e.Lease) {
			if _, err := r.apply(ctx, k, e, lease.Reuse{Instance: e.Lease.Instance, Now: now}); err != nil {
				return Decision{}, err
			}
			return Decision{Action: Reused, Markers: markers(k, e.Lease)}, nil
		}
		if d.Kind == provider.Absent { // the owned wrapper is verifiably gone
			if e, err = r.apply(ctx, k, e, lease.OwnedAbsent{Instance: e.Lease.Instance}); err != nil {
				return Decision{}, err
			}
		}
	}
	if e.Lease.State != lease.None || d.Kind != provider.Absent {
		if e, err = r.apply(ctx, k, e, lease.RequestStop{Reason: ReasonMismatch, Now: now}); err != nil {
			return Decision{}, err
		}
		r.kick()
		return r.refuse(e.Lease, ReasonMismatch)
	}
	if e, err = r.apply(ctx, k, e, lease.Allocate{Instance: newInstance(), Now: now}); err != nil {
		return Decision{}, err
	}
	m := markers(k, e.Lease)
	if err := launch(ctx, m); err != nil {
		// The process may or may not exist: stop the key, never forget it.
		if _, perr := r.apply(ctx, k, e, lease.RequestStop{Reason: ReasonLaunchFailed, Now: r.cfg.Now()}); perr != nil {
			err = errors.Join(err, perr)
		}
		r.kick()
		return Decision{}, fmt.Errorf("reconciler: launch: %w", err)
	}
	return Decision{Action: Launched, Markers: m}, nil
}

func (r *Reconciler) refuse(l lease.Lease, reason string) (Decision, error) {
	return Decision{Action: Refused, RetryAfter: r.retryAfter(l), Reason: reason}, fmt.Errorf("%w: %s", ErrRefused, reason)
}

// retryAfter says when asking again may find the stop further along.
func (r *Reconciler) retryAfter(l lease.Lease) time.Duration {
	now := r.cfg.Now()
	d := minRetry
	switch {
	case l.State == lease.Stopping:
		d = l.WatchdogAt.Sub(now)
	case l.State == lease.StopNeeded && !l.NextAttemptAt.IsZero():
		d = l.NextAttemptAt.Sub(now)
	case l.State == lease.StopNeeded:
		d = r.cfg.Policy.RecheckEvery
	}
	return max(d, minRetry)
}

func matches(o provider.Observed, l lease.Lease) bool {
	return !o.Unmarked && o.InstanceID == l.Instance && o.Generation == l.Generation
}

func markers(k keyRef, l lease.Lease) provider.Markers {
	return provider.Markers{SandboxID: k.sandbox, RuntimeKey: k.key, InstanceID: l.Instance, Generation: l.Generation}
}

func newInstance() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return "wi-" + hex.EncodeToString(b)
}

// StartupVerified records that the wrapper of instance said Hello and its
// workspace is ready.
func (r *Reconciler) StartupVerified(ctx context.Context, sandboxID, runtimeKey, instance string) error {
	return r.event(ctx, sandboxID, runtimeKey, lease.StartupVerified{Instance: instance, Now: r.cfg.Now()})
}

// DeliveryAccepted records work delivered to the wrapper of instance.
func (r *Reconciler) DeliveryAccepted(ctx context.Context, sandboxID, runtimeKey, instance string) error {
	return r.event(ctx, sandboxID, runtimeKey, lease.DeliveryAccepted{Instance: instance, Now: r.cfg.Now()})
}

// RetainWarm keeps the wrapper of instance until until (keep-warm after a
// turn is now + Policy.KeepWarm).
func (r *Reconciler) RetainWarm(ctx context.Context, sandboxID, runtimeKey, instance string, until time.Time) error {
	return r.event(ctx, sandboxID, runtimeKey, lease.RetainWarm{Instance: instance, Until: until})
}

// WrapperGone releases the lease of instance on verified absence; if a
// wrapper of the key is still there it requests a stop; if the provider
// cannot look it changes nothing and returns ErrInspectionFailed.
func (r *Reconciler) WrapperGone(ctx context.Context, sandboxID, runtimeKey, instance string) error {
	k, e, unlock, err := r.open(ctx, sandboxID, runtimeKey)
	if err != nil {
		return err
	}
	defer unlock()
	if e.Lease.State != lease.OwnsWrapper || e.Lease.Instance != instance {
		return nil // stale
	}
	switch d := r.cfg.Provider.Discover(ctx, sandboxID, runtimeKey); d.Kind {
	case provider.Absent:
		_, err = r.apply(ctx, k, e, lease.OwnedAbsent{Instance: instance})
	case provider.Present:
		_, err = r.apply(ctx, k, e, lease.RequestStop{Reason: ReasonGone, Now: r.cfg.Now()})
		r.kick()
	default:
		err = fmt.Errorf("%w: %w", ErrInspectionFailed, d.Err)
	}
	return err
}

// RequestStop requests a stop of every wrapper of the runtime key; the Run
// loop (or AbsenceVerified) drives it.
func (r *Reconciler) RequestStop(ctx context.Context, sandboxID, runtimeKey, reason string) error {
	err := r.event(ctx, sandboxID, runtimeKey, lease.RequestStop{Reason: reason, Now: r.cfg.Now()})
	r.kick()
	return err
}

// AbsenceVerified reports whether no wrapper of the key can run: the lease
// is none and discovery verified absence. Otherwise it drives the stop one
// step (an attempt if one is due) and returns when to ask again. A leaked
// wrapper found under a none lease gets a stop requested. An inspection
// failure is never absence.
func (r *Reconciler) AbsenceVerified(ctx context.Context, sandboxID, runtimeKey string) (bool, time.Duration, error) {
	k, e, unlock, err := r.open(ctx, sandboxID, runtimeKey)
	if err != nil {
		return false, 0, err
	}
	defer unlock()
	if e.Lease.State == lease.None {
		switch d := r.cfg.Provider.Discover(ctx, sandboxID, runtimeKey); d.Kind {
		case provider.Absent:
			return true, 0, nil
		case provider.Present:
			if e, err = r.apply(ctx, k, e, lease.RequestStop{Reason: ReasonLeaked, Now: r.cfg.Now()}); err != nil {
				return false, 0, err
			}
		default:
			return false, r.cfg.Policy.RetryDelays[0], nil
		}
	}
	if e, err = r.step(ctx, k, e, true); err != nil {
		return false, 0, err
	}
	if e.Lease.State == lease.None {
		return true, 0, nil
	}
	return false, r.retryAfter(e.Lease), nil
}

// ForgetKey drops the lease of a runtime key whose last session is gone
// (DESIGN.md 3.5: nothing outlives its session): only a none lease that
// parses, with nothing of the key discovered; anything else stays tracked.
func (r *Reconciler) ForgetKey(ctx context.Context, sandboxID, runtimeKey string) error {
	k, e, unlock, err := r.open(ctx, sandboxID, runtimeKey)
	if err != nil {
		return err
	}
	defer unlock()
	if e.Lease.State != lease.None || e.Quarantined != nil {
		return nil
	}
	if d := r.cfg.Provider.Discover(ctx, sandboxID, runtimeKey); d.Kind != provider.Absent {
		return nil
	}
	return r.store.Drop(ctx, k.fence.Resource(), k.fence.Token(), runtimeKey, e)
}

// DeletionAllowed is AbsenceVerified, plus DESIGN.md 3.5's exception: an
// exhausted lease allows deletion after a final observation (the lease
// itself stays exhausted and keeps being tracked).
func (r *Reconciler) DeletionAllowed(ctx context.Context, sandboxID, runtimeKey string) (bool, time.Duration, error) {
	ok, retry, err := r.AbsenceVerified(ctx, sandboxID, runtimeKey)
	if ok || err != nil {
		return ok, retry, err
	}
	l, err := r.Lease(ctx, sandboxID, runtimeKey)
	if err != nil {
		return false, 0, err
	}
	if l.State == lease.StopNeeded && l.Exhausted && l.FinalObserved {
		return true, 0, nil
	}
	return false, retry, nil
}

// Lease reads the lease of a runtime key (quarantined if unparseable).
func (r *Reconciler) Lease(ctx context.Context, sandboxID, runtimeKey string) (lease.Lease, error) {
	k, err := r.ref(sandboxID, runtimeKey)
	if err != nil {
		return lease.Lease{}, err
	}
	e, err := r.get(ctx, k)
	return e.Lease, err
}

// step applies what is due for the lease now: a deadline stop, an expired
// attempt, or a stop attempt. final allows an exhausted lease's final
// observation outside its recheck schedule. The caller holds the key lock.
func (r *Reconciler) step(ctx context.Context, k keyRef, e leasestore.Entry, final bool) (leasestore.Entry, error) {
	for range 3 { // deadline stop → attempt, or expiry → attempt
		now := r.cfg.Now()
		ev, due := lease.Due(e.Lease, now)
		if !due && final && e.Lease.State == lease.StopNeeded && e.Lease.Exhausted && !e.Lease.FinalObserved && e.Lease.NextAttemptAt.IsZero() {
			ev, due = lease.BeginStopAttempt{Attempt: e.Lease.LastAttempt + 1, Now: now, Final: true}, true
		}
		if !due {
			return e, nil
		}
		if b, ok := ev.(lease.BeginStopAttempt); ok {
			return r.attempt(ctx, k, e, b)
		}
		next, err := r.apply(ctx, k, e, ev)
		if err != nil {
			return e, err
		}
		if next.Lease == e.Lease {
			return next, nil
		}
		e = next
	}
	return e, nil
}

// attempt runs one stop attempt: persist the stopping claim, then call the
// provider, then persist the result for this attempt only.
func (r *Reconciler) attempt(ctx context.Context, k keyRef, e leasestore.Entry, b lease.BeginStopAttempt) (leasestore.Entry, error) {
	claimed, err := r.apply(ctx, k, e, b)
	if err != nil {
		return e, err
	}
	if claimed.Lease.State != lease.Stopping || claimed.Lease.LastAttempt != b.Attempt {
		return claimed, nil
	}
	if r.cfg.BeforeStop != nil {
		r.cfg.BeforeStop(ctx, k.sandbox, k.key, b.Attempt)
	}
	if err := ctx.Err(); err != nil {
		return claimed, err // the watchdog takes over
	}
	if !r.cfg.Now().Before(claimed.Lease.WatchdogAt) {
		// Too late: a successor may already run the next attempt. Never
		// overlap it; AttemptExpired ends this one.
		return claimed, nil
	}
	// The attempt must end before its watchdog, or a successor may start.
	sctx, cancel := context.WithDeadline(ctx, time.Now().Add(claimed.Lease.WatchdogAt.Sub(r.cfg.Now())))
	sctx, span := startStopSpan(sctx, int(b.Attempt))
	res := r.cfg.Provider.Stop(sctx, provider.StopTarget{SandboxID: k.sandbox, RuntimeKey: k.key, InstanceID: claimed.Lease.StopInstance})
	endStopSpan(span, res)
	r.cfg.Metrics.stopAttempt(res.Kind)
	cancel()
	// Re-read: the result applies only if this attempt is still current.
	cur, err := r.get(ctx, k)
	if err != nil {
		return claimed, err
	}
	var ev lease.Event = lease.StopNotConfirmed{Attempt: b.Attempt, Now: r.cfg.Now()}
	if res.Kind == provider.StopAbsent {
		ev = lease.StopAbsent{Attempt: b.Attempt}
	}
	next, err := r.apply(ctx, k, cur, ev)
	if err != nil {
		return cur, err
	}
	r.log.Info("wrapper stop attempt", "sandbox", k.sandbox, "runtime_key", k.key, "attempt", b.Attempt,
		"result", res.Kind, "state", next.Lease.State, "exhausted", next.Lease.Exhausted, "err", res.Err)
	if next.Lease.State == lease.None && r.cfg.Stopped != nil {
		r.cfg.Stopped(k.sandbox, k.key)
	}
	return next, nil
}

// Tick runs one pass over every adopted sandbox's leases. It continues past
// errors of single keys and returns them joined.
func (r *Reconciler) Tick(ctx context.Context) error {
	var errs []error
	var census leaseCensus
	defer func() { r.cfg.Metrics.census(census) }()
	for _, sb := range r.sandboxes() {
		f, err := r.fence(sb)
		if err != nil {
			continue // forgotten meanwhile
		}
		all, err := r.store.All(ctx, f.Resource())
		if err != nil {
			errs = append(errs, err)
			continue
		}
		census.add(all) // as read: the tick's own changes show in the next one
		for _, rk := range sortedKeys(all) {
			if err := r.tickKey(ctx, keyRef{sandbox: sb, key: rk, fence: f}); err != nil {
				errs = append(errs, fmt.Errorf("%s/%s: %w", sb, rk, err))
			}
		}
	}
	return errors.Join(errs...)
}

func (r *Reconciler) tickKey(ctx context.Context, k keyRef) error {
	defer r.lock(k.sandbox, k.key)()
	e, err := r.get(ctx, k)
	if err != nil {
		return err
	}
	_, err = r.step(ctx, k, e, false)
	return err
}

// Sweep is the leak sweep of one adopted sandbox: every runtime key that
// has a lease or a discovered process is checked, and a stop is requested
// for any wrapper the lease does not own (a none lease with wrappers, a
// mismatch, duplicates, an unmarked one). Inspection failure changes
// nothing.
func (r *Reconciler) Sweep(ctx context.Context, sandboxID string) error {
	f, err := r.fence(sandboxID)
	if err != nil {
		return err
	}
	all, err := r.store.All(ctx, f.Resource())
	if err != nil {
		return err
	}
	keys := map[string]bool{}
	for rk := range all {
		keys[rk] = true
	}
	if inv, ok := r.cfg.Provider.(provider.Inventory); ok {
		sd := inv.DiscoverSandbox(ctx, sandboxID)
		if sd.Kind == provider.InspectionFailed {
			return fmt.Errorf("%w: %w", ErrInspectionFailed, sd.Err)
		}
		for rk := range sd.ByRuntimeKey {
			keys[rk] = true
		}
	}
	var errs []error
	for _, rk := range sortedKeys(keys) {
		if err := r.sweepKey(ctx, keyRef{sandbox: sandboxID, key: rk, fence: f}); err != nil {
			errs = append(errs, fmt.Errorf("%s/%s: %w", sandboxID, rk, err))
		}
	}
	r.kick()
	return errors.Join(errs...)
}

func (r *Reconciler) sweepKey(ctx context.Context, k keyRef) error {
	defer r.lock(k.sandbox, k.key)()
	e, err := r.get(ctx, k)
	if err != nil {
		return err
	}
	if e.Lease.State != lease.None && e.Lease.State != lease.OwnsWrapper {
		return nil // a stop is already pending; Tick drives it
	}
	// Discover again under the key lock: the sandbox-wide listing may
	// predate a launch that finished since.
	d := r.cfg.Provider.Discover(ctx, k.sandbox, k.key)
	switch {
	case d.Kind == provider.InspectionFailed:
		return fmt.Errorf("%w: %w", ErrInspectionFailed, d.Err)
	case d.Kind == provider.Absent:
		return nil // an owned wrapper that is gone is released by WrapperGone or its deadline
	case e.Lease.State == lease.OwnsWrapper && len(d.Observed) == 1 && matches(d.Observed[0], e.Lease):
		return nil
	}
	reason := ReasonLeaked
	if e.Lease.State == lease.OwnsWrapper {
		reason = ReasonMismatch
	}
	r.log.Warn("leaked wrapper found", "sandbox", k.sandbox, "runtime_key", k.key, "count", len(d.Observed), "reason", reason)
	r.cfg.Metrics.leakFound(reason)
	_, err = r.apply(ctx, k, e, lease.RequestStop{Reason: reason, Now: r.cfg.Now()})
	return err
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func (r *Reconciler) kick() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Run ticks every TickEvery (and when a stop is requested) and sweeps every
// SweepEvery until ctx ends. Errors are logged; it returns nil when ctx
// ends.
func (r *Reconciler) Run(ctx context.Context) error {
	tick := time.NewTicker(r.cfg.TickEvery)
	defer tick.Stop()
	sweep := time.NewTicker(r.cfg.SweepEvery)
	defer sweep.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-sweep.C:
			for _, sb := range r.sandboxes() {
				if err := r.Sweep(ctx, sb); err != nil && ctx.Err() == nil {
					r.log.Warn("leak sweep failed", "sandbox", sb, "err", err)
				}
			}
		case <-tick.C:
		case <-r.wake:
		}
		if err := r.Tick(ctx); err != nil && ctx.Err() == nil {
			r.log.Warn("reconcile tick failed", "err", err)
		}
	}
}
