// Package lease is the physical wrapper lease of one runtime key (DESIGN.md
// 3.2) as a pure transition function: Apply(lease, event) returns the next
// lease and never does I/O. An event that does not apply (wrong state, stale
// instance id, stale attempt id, too early) returns the lease unchanged.
//
// States: none | owns_wrapper | stop_needed (with the exhausted sub-state) |
// stopping. Every state carries NextGeneration, which never decreases.
// owns_wrapper becomes none only on verified absence (OwnedAbsent or
// StopAbsent); inspection failures are never events of this package, so they
// can never release a lease.
package lease

import (
	"time"
)

// State of a wrapper lease.
type State string

const (
	None        State = "none"
	OwnsWrapper State = "owns_wrapper"
	StopNeeded  State = "stop_needed"
	Stopping    State = "stopping"
)

// Policy holds the lease's timings (DESIGN.md 3.2 defaults in DefaultPolicy).
type Policy struct {
	Watchdog       time.Duration   // bound of one stop attempt (stopping claim)
	RetryDelays    []time.Duration // delay before attempt n+1 after attempt n was not confirmed
	MaxAttempts    int             // attempts before the lease is exhausted
	RecheckFirst   time.Duration   // exhausted: first re-observation this long after exhaustion, then doubling ...
	RecheckEvery   time.Duration   // ... up to this interval ...
	RecheckFor     time.Duration   // ... for this long after exhaustion
	StartupTimeout time.Duration   // launch → startup verified
	ReadyTimeout   time.Duration   // startup verified (workspace ready) → first work
	KeepWarm       time.Duration   // after a turn
	IdleTimeout    time.Duration   // a wrapper idle this long with no work is stopped
}

// DefaultPolicy is DESIGN.md 3.2: 45 s watchdog; retries after 5, 10, 10,
// 10 s; exhausted after 5 attempts; rechecks 10 s after exhaustion, then
// at doubling intervals up to every 10 min, for 60 min;
// startup 10 min, then 60 s once the workspace is ready; keep-warm 5 min;
// idle 15 min.
func DefaultPolicy() Policy {
	return Policy{
		Watchdog:       45 * time.Second,
		RetryDelays:    []time.Duration{5 * time.Second, 10 * time.Second, 10 * time.Second, 10 * time.Second},
		MaxAttempts:    5,
		RecheckFirst:   10 * time.Second,
		RecheckEvery:   10 * time.Minute,
		RecheckFor:     60 * time.Minute,
		StartupTimeout: 10 * time.Minute,
		ReadyTimeout:   60 * time.Second,
		KeepWarm:       5 * time.Minute,
		IdleTimeout:    15 * time.Minute,
	}
}

// Stop reasons used by this package and the reconciler.
const (
	ReasonStartupTimeout = "startup_timeout" // not verified / no work before the startup deadline
	ReasonIdle           = "idle"            // idle with no work
	ReasonQuarantine     = "unparseable_lease"
)

// Lease is the persisted wrapper lease of one runtime key.
type Lease struct {
	State State `json:"state"`
	// Exhausted is the sub-state of stop_needed (and of the stopping recheck
	// that came from it): cleanup gave up retrying on the fast schedule.
	Exhausted bool `json:"exhausted,omitempty"`
	// NextGeneration is the generation the next allocation gets; it never
	// decreases, so a wrapper of an older allocation is never mistaken for
	// the current one.
	NextGeneration uint64 `json:"next_generation"`

	// owns_wrapper: the wrapper this lease owns.
	Instance   string `json:"instance,omitempty"`
	Generation uint64 `json:"generation,omitempty"`
	// Verified is set by StartupVerified (the wrapper said Hello and its
	// workspace is ready).
	Verified bool `json:"verified,omitempty"`
	// StopAfter is when the wrapper is due for a stop if nothing extends
	// it: the startup deadline, then the ready deadline, then keep-warm or
	// idle. Due reports it.
	StopAfter time.Time `json:"stop_after,omitzero"`

	// stop_needed / stopping.
	StopInstance  string    `json:"stop_instance,omitempty"` // empty: every wrapper of the key
	StopReason    string    `json:"stop_reason,omitempty"`
	Attempts      int       `json:"attempts,omitempty"`       // attempts begun since the stop was requested
	LastAttempt   uint64    `json:"last_attempt,omitempty"`   // id of the newest attempt ever begun; never decreases
	NextAttemptAt time.Time `json:"next_attempt_at,omitzero"` // stop_needed: earliest next attempt (zero: only a Final one)
	WatchdogAt    time.Time `json:"watchdog_at,omitzero"`     // stopping: the attempt expires then
	ExhaustedAt   time.Time `json:"exhausted_at,omitzero"`    // when the exhausted sub-state began
	// FinalAttempt marks a stopping attempt begun with Final; FinalObserved
	// records that such a final observation of an exhausted lease did not
	// verify absence (a deletion may then proceed; the lease stays).
	FinalAttempt  bool `json:"final_attempt,omitempty"`
	FinalObserved bool `json:"final_observed,omitempty"`
}

// Event is one input of the transition function.
type Event interface{ isEvent() }

// Allocate: none → owns_wrapper with generation NextGeneration.
type Allocate struct {
	Instance string
	Now      time.Time
}

// StartupVerified: the wrapper of Instance said Hello and its workspace is
// ready; the startup deadline shrinks to ReadyTimeout.
type StartupVerified struct {
	Instance string
	Now      time.Time
}

// DeliveryAccepted: work was delivered to the wrapper of Instance.
type DeliveryAccepted struct {
	Instance string
	Now      time.Time
}

// RetainWarm keeps the wrapper of Instance until Until (keep-warm after a
// turn, or activity while a turn runs).
type RetainWarm struct {
	Instance string
	Until    time.Time
}

// Reuse: an existing wrapper of Instance was reused for a new route.
type Reuse struct {
	Instance string
	Now      time.Time
}

// OwnedAbsent: discovery verified that the owned wrapper is gone.
type OwnedAbsent struct {
	Instance string
}

// RequestStop: none, owns_wrapper → stop_needed. Instance "" targets every
// wrapper of the runtime key.
type RequestStop struct {
	Instance string
	Reason   string
	Now      time.Time
}

// BeginStopAttempt claims stop attempt Attempt (must be newer than every
// attempt begun before) when it is due. Final forces an attempt of an
// exhausted lease outside its recheck schedule (a deletion's final
// observation).
type BeginStopAttempt struct {
	Attempt uint64
	Now     time.Time
	Final   bool
}

// StopAbsent: attempt Attempt verified absence: stopping → none.
type StopAbsent struct {
	Attempt uint64
}

// StopNotConfirmed: attempt Attempt could not verify absence (still present
// or inspection failed): stopping → stop_needed with backoff from Now.
type StopNotConfirmed struct {
	Attempt uint64
	Now     time.Time
}

// AttemptExpired: the watchdog of the current attempt passed without a
// result (the stopper crashed): stopping → stop_needed with backoff.
type AttemptExpired struct {
	Now time.Time
}

// CleanupExhausted: stop_needed after MaxAttempts attempts →
// stop_needed.exhausted. Apply also enters it by itself when an attempt
// fails after the last one.
type CleanupExhausted struct {
	Now time.Time
}

func (Allocate) isEvent()         {}
func (StartupVerified) isEvent()  {}
func (DeliveryAccepted) isEvent() {}
func (RetainWarm) isEvent()       {}
func (Reuse) isEvent()            {}
func (OwnedAbsent) isEvent()      {}
func (RequestStop) isEvent()      {}
func (BeginStopAttempt) isEvent() {}
func (StopAbsent) isEvent()       {}
func (StopNotConfirmed) isEvent() {}
func (AttemptExpired) isEvent()   {}
func (CleanupExhausted) isEvent() {}

// Apply is the transition function. It is pure: the result depends only on
// its arguments.
func Apply(p Policy, l Lease, ev Event) Lease {
	if l.State == "" {
		l.State = None
	}
	switch e := ev.(type) {
	case Allocate:
		if l.State != None || e.Instance == "" {
			return l
		}
		return Lease{
			State:          OwnsWrapper,
			NextGeneration: l.NextGeneration + 1,
			Instance:       e.Instance,
			Generation:     l.NextGeneration,
			StopAfter:      e.Now.Add(p.StartupTimeout),
			LastAttempt:    l.LastAttempt,
		}
	case StartupVerified:
		if !l.owns(e.Instance) || l.Verified {
			return l
		}
		l.Verified = true
		l.StopAfter = e.Now.Add(p.ReadyTimeout)
		return l
	case DeliveryAccepted:
		if !l.owns(e.Instance) {
			return l
		}
		l.StopAfter = later(l.StopAfter, e.Now.Add(p.IdleTimeout))
		return l
	case RetainWarm:
		if !l.owns(e.Instance) {
			return l
		}
		l.StopAfter = later(l.StopAfter, e.Until)
		return l
	case Reuse:
		if !l.owns(e.Instance) {
			return l
		}
		l.StopAfter = later(l.StopAfter, e.Now.Add(p.IdleTimeout))
		return l
	case OwnedAbsent:
		if !l.owns(e.Instance) {
			return l
		}
		return Lease{State: None, NextGeneration: l.NextGeneration, LastAttempt: l.LastAttempt}
	case RequestStop, BeginStopAttempt, StopAbsent, StopNotConfirmed, AttemptExpired, CleanupExhausted:
		return applyStop(p, l, ev)
	}
	return l
}

// applyStop applies the events of a stop: its request and its attempts.
func applyStop(p Policy, l Lease, ev Event) Lease {
	switch e := ev.(type) {
	case RequestStop:
		if l.State != None && l.State != OwnsWrapper {
			return l
		}
		return Lease{
			State:          StopNeeded,
			NextGeneration: l.NextGeneration,
			StopInstance:   e.Instance,
			StopReason:     e.Reason,
			LastAttempt:    l.LastAttempt,
			NextAttemptAt:  e.Now,
		}
	case BeginStopAttempt:
		if l.State != StopNeeded || e.Attempt <= l.LastAttempt {
			return l
		}
		due := !l.NextAttemptAt.IsZero() && !e.Now.Before(l.NextAttemptAt)
		if !due && !(e.Final && l.Exhausted) {
			return l
		}
		l.State = Stopping
		l.FinalAttempt = e.Final && l.Exhausted
		l.Attempts++
		l.LastAttempt = e.Attempt
		l.WatchdogAt = e.Now.Add(p.Watchdog)
		l.NextAttemptAt = time.Time{}
		return l
	case StopAbsent:
		if l.State != Stopping || e.Attempt != l.LastAttempt {
			return l
		}
		return Lease{State: None, NextGeneration: l.NextGeneration, LastAttempt: l.LastAttempt}
	case StopNotConfirmed:
		if l.State != Stopping || e.Attempt != l.LastAttempt {
			return l
		}
		return l.backoff(p, e.Now)
	case AttemptExpired:
		if l.State != Stopping || e.Now.Before(l.WatchdogAt) {
			return l
		}
		return l.backoff(p, e.Now)
	case CleanupExhausted:
		if l.State != StopNeeded || l.Exhausted || l.Attempts < p.MaxAttempts {
			return l
		}
		return l.exhaust(p, e.Now)
	}
	return l
}

func (l Lease) owns(instance string) bool {
	return l.State == OwnsWrapper && instance != "" && instance == l.Instance
}

// backoff ends a stopping attempt without verified absence.
func (l Lease) backoff(p Policy, now time.Time) Lease {
	l.State = StopNeeded
	l.WatchdogAt = time.Time{}
	if l.Exhausted && l.FinalAttempt {
		l.FinalObserved = true
	}
	l.FinalAttempt = false
	if l.Exhausted {
		return l.recheck(p, now)
	}
	if l.Attempts >= p.MaxAttempts {
		return l.exhaust(p, now)
	}
	l.NextAttemptAt = now.Add(retryDelay(p, l.Attempts))
	return l
}

func (l Lease) exhaust(p Policy, now time.Time) Lease {
	l.Exhausted = true
	l.ExhaustedAt = now
	return l.recheck(p, now)
}

// recheck schedules the next observation of an exhausted lease on a fixed
// grid that starts short and backs off: ExhaustedAt + RecheckFirst, then
// intervals doubling up to RecheckEvery, up to RecheckFor (a slow
// observation does not push the schedule). Attempts exhausted by an
// inspection outage (an unreadable /proc is never absence) so see the
// recovered inspection soon after it recovers, not only at the next
// 10-minute step (issue 33 item 7); a wrapper that truly cannot be stopped
// is looked at no more often than every RecheckEvery once the backoff
// reaches it. After the window only a Final attempt runs.
func (l Lease) recheck(p Policy, now time.Time) Lease {
	l.NextAttemptAt = time.Time{}
	if p.RecheckEvery <= 0 || l.ExhaustedAt.IsZero() {
		return l
	}
	step := min(p.RecheckFirst, p.RecheckEvery)
	if step <= 0 {
		step = p.RecheckEvery
	}
	next := l.ExhaustedAt.Add(step)
	for !next.After(now) {
		step = min(2*step, p.RecheckEvery)
		next = next.Add(step)
	}
	if !next.After(l.ExhaustedAt.Add(p.RecheckFor)) {
		l.NextAttemptAt = next
	}
	return l
}

func retryDelay(p Policy, attempts int) time.Duration {
	if len(p.RetryDelays) == 0 {
		return 0
	}
	i := attempts - 1
	if i < 0 {
		i = 0
	}
	if i >= len(p.RetryDelays) {
		i = len(p.RetryDelays) - 1
	}
	return p.RetryDelays[i]
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// Due reports the event the reconciler should apply at now, if any: a stop
// of an owned wrapper whose StopAfter passed (startup or idle), an expired
// attempt, or a due stop attempt (the caller fills in the attempt id).
func Due(l Lease, now time.Time) (Event, bool) {
	switch l.State {
	case OwnsWrapper:
		if !l.StopAfter.IsZero() && !now.Before(l.StopAfter) {
			reason := ReasonIdle
			if !l.Verified {
				reason = ReasonStartupTimeout
			}
			return RequestStop{Reason: reason, Now: now}, true
		}
	case Stopping:
		if !now.Before(l.WatchdogAt) {
			return AttemptExpired{Now: now}, true
		}
	case StopNeeded:
		if !l.NextAttemptAt.IsZero() && !now.Before(l.NextAttemptAt) {
			return BeginStopAttempt{Attempt: l.LastAttempt + 1, Now: now}, true
		}
	}
	return nil, false
}

// HoldsDelivery reports whether delivery must be held: a stop is pending or
// running.
func (l Lease) HoldsDelivery() bool { return l.State == StopNeeded || l.State == Stopping }
