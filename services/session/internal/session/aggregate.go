package session

import (
	"slices"
	"time"
)

// EventKind says what an event of the session's log describes.
type EventKind string

const (
	EventRoute    EventKind = "route"
	EventMessage  EventKind = "message"
	EventSession  EventKind = "session"
	EventRuntime  EventKind = "runtime"
	EventOutcome  EventKind = "outcome"
	EventProgress EventKind = "progress"
)

// Event is one entry of the session's event log. Domain kinds carry a
// snapshot; runtime, outcome and progress events carry the payload exactly as
// the API layer encoded it (the domain only routes them).
type Event struct {
	Kind    EventKind
	Time    time.Time
	Route   *RouteView
	Message *Message // without content
	Session *Session
	Payload []byte
}

// Aggregate is a session with its unfinished (queued or accepted) messages,
// loaded together so a transition sees everything it may change.
type Aggregate struct {
	Session Session
	// Active holds queued and accepted messages in queue order.
	Active []*Message
	// Lookup is the message the caller asked the store to load by id (any
	// state), or nil when it does not exist.
	Lookup *Message
	// Seen holds the dedup ids (turn ids) the caller asked about that were
	// already recorded.
	Seen map[string]bool
	// Intent is the persisted deletion intent, nil while none exists.
	Intent *DeletionIntent

	sessionChanged bool
	changed        []*Message
	events         []Event
	seenAdded      []string
	intentChanged  bool
	resumed        *ResumeEnd
}

// ResumeEnd is how a resume of a suspended route ended, in this change.
type ResumeEnd struct {
	Ready bool          // the route became ready (else it failed)
	Took  time.Duration // from ResumeSince to the end
}

// Resumed reports a resume this change ended, or nil.
func (a *Aggregate) Resumed() *ResumeEnd { return a.resumed }

// IntentChanged reports whether the deletion intent must be written.
func (a *Aggregate) IntentChanged() bool { return a.intentChanged }

// SessionChanged reports whether the session record must be written.
func (a *Aggregate) SessionChanged() bool { return a.sessionChanged }

// Changed returns the messages to write, each once.
func (a *Aggregate) Changed() []*Message { return a.changed }

// Events returns the events to append, in order.
func (a *Aggregate) Events() []Event { return a.events }

// SeenAdded returns dedup ids to record.
func (a *Aggregate) SeenAdded() []string { return a.seenAdded }

func (a *Aggregate) touch(now time.Time) {
	a.Session.UpdateTime = now
	a.sessionChanged = true
}

func (a *Aggregate) emit(e Event) { a.events = append(a.events, e) }

func (a *Aggregate) markChanged(m *Message) {
	if !slices.Contains(a.changed, m) {
		a.changed = append(a.changed, m)
	}
}

func (a *Aggregate) setMessage(m *Message, st MessageState, reason string, now time.Time) {
	if m.State.Terminal() || m.State == st {
		return // terminal states are final
	}
	m.State, m.FailureReason, m.UpdateTime = st, reason, now
	if st == MessageAccepted {
		m.AcceptTime = now
	}
	a.markChanged(m)
	snap := *m
	snap.Content = ""
	a.emit(Event{Kind: EventMessage, Time: now, Message: &snap})
	a.touch(now)
}

func (a *Aggregate) setRoute(v RouteView, now time.Time) {
	v.SandboxID = a.Session.SandboxID
	v.FenceToken = max(v.FenceToken, a.Session.Route.FenceToken)
	v.UpdateTime = now
	old := a.Session.Route
	a.Session.Route = v
	a.Session.recordRuntimeSession(v.RuntimeSessionID)
	a.trackResume(old.State, v.State, now)
	a.touch(now)
	old.UpdateTime, v.UpdateTime = time.Time{}, time.Time{}
	if old != v {
		snap := a.Session.Route
		a.emit(Event{Kind: EventRoute, Time: now, Route: &snap})
	}
}

// trackResume keeps ResumeSince: set when a suspended route starts to
// come back (unless a message or ResumeSession set it earlier), ended by a
// ready or failed route (the change then reports it: Resumed) and dropped
// when the route is suspended again.
func (a *Aggregate) trackResume(from, to RouteState, now time.Time) {
	if from == RouteSuspended && to != RouteSuspended && a.Session.ResumeSince.IsZero() {
		a.Session.ResumeSince = now
	}
	since := a.Session.ResumeSince
	if since.IsZero() {
		return
	}
	switch to {
	case RouteReady, RouteFailed:
		a.resumed = &ResumeEnd{Ready: to == RouteReady, Took: max(now.Sub(since), 0)}
		a.Session.ResumeSince = time.Time{}
	case RouteSuspended:
		a.Session.ResumeSince = time.Time{}
	}
}

// BeginResume records that a suspended route is asked to resume now
// (ResumeSession; a message does the same in Send). It reports whether
// the session changed.
func (a *Aggregate) BeginResume(now time.Time) bool {
	if a.Session.Route.State != RouteSuspended || !a.Session.ResumeSince.IsZero() {
		return false
	}
	a.Session.ResumeSince = now
	a.touch(now)
	return true
}

func (a *Aggregate) failWhere(pred func(*Message) bool, st MessageState, reason string, now time.Time) int {
	n := 0
	for _, m := range a.Active {
		if pred(m) && !m.State.Terminal() {
			a.setMessage(m, st, reason, now)
			n++
		}
	}
	return n
}

func isAccepted(m *Message) bool { return m.State == MessageAccepted }
func isActive(m *Message) bool   { return !m.State.Terminal() }

// Queued returns queued messages in queue order.
func (a *Aggregate) Queued() []*Message {
	var out []*Message
	for _, m := range a.Active {
		if m.State == MessageQueued {
			out = append(out, m)
		}
	}
	return out
}

// HasAccepted reports whether a turn may be running.
func (a *Aggregate) HasAccepted() bool { return slices.ContainsFunc(a.Active, isAccepted) }

// Send queues a message, or returns the stored one when the same id was sent
// with the same content before. Other content under the same id is
// ErrMessageConflict. A stopped session becomes active again.
func (a *Aggregate) Send(id, content string, now time.Time) (*Message, bool, error) {
	if a.Session.State == StateDeleting {
		return nil, false, ErrSessionNotFound
	}
	digest := Digest(content)
	if a.Lookup != nil {
		if a.Lookup.ContentDigest != digest {
			return nil, false, ErrMessageConflict
		}
		return a.Lookup, false, nil
	}
	a.Session.LastSeq++
	m := &Message{
		SessionID: a.Session.ID, ID: id, Content: content, ContentDigest: digest,
		State: MessageQueued, Seq: a.Session.LastSeq, CreateTime: now, UpdateTime: now,
	}
	a.Active = append(a.Active, m)
	a.markChanged(m)
	snap := *m
	snap.Content = ""
	a.emit(Event{Kind: EventMessage, Time: now, Message: &snap})
	if a.Session.State == StateStopped {
		a.Session.State = StateActive
		a.emitSession(now)
	}
	a.BeginResume(now)
	a.touch(now)
	return m, true, nil
}

func (a *Aggregate) emitSession(now time.Time) {
	snap := a.Session
	a.emit(Event{Kind: EventSession, Time: now, Session: &snap})
}

// Accept marks the delivered messages accepted (those still queued).
func (a *Aggregate) Accept(ids []string, now time.Time) {
	for _, m := range a.Active {
		if m.State == MessageQueued && slices.Contains(ids, m.ID) {
			a.setMessage(m, MessageAccepted, "", now)
		}
	}
}

// Cancel cancels a queued or accepted message; a terminal one is returned
// unchanged. It reports whether an abort should be sent (accepted work).
func (a *Aggregate) Cancel(now time.Time) (msg *Message, abort bool) {
	m := a.Lookup
	if m == nil {
		return nil, false
	}
	for _, act := range a.Active {
		if act.ID == m.ID {
			m = act
		}
	}
	abort = m.State == MessageAccepted
	a.setMessage(m, MessageCancelled, "", now)
	return m, abort
}

// Stop cancels queued and accepted work and marks the session stopped. It
// reports whether accepted work was running (an abort should be sent).
func (a *Aggregate) Stop(now time.Time) (abort bool) {
	abort = a.HasAccepted()
	a.failWhere(isActive, MessageCancelled, "", now)
	if a.Session.State != StateStopped {
		a.Session.State = StateStopped
		a.touch(now)
		a.emitSession(now)
	}
	return abort
}

// Notice is what the sandbox says about the route, with the fencing token
// of the sandbox owner that said it.
type Notice struct {
	SandboxID  string
	FenceToken uint64
}

// Accepts reports whether a route notification applies: it names the
// session's sandbox and comes from its current sandbox owner (a fencing
// token, never zero, not older than the newest seen).
func (a *Aggregate) Accepts(n Notice) bool {
	if a.Session.State == StateDeleting {
		return false
	}
	if n.SandboxID != "" && n.SandboxID != a.Session.SandboxID {
		return false
	}
	return n.FenceToken != 0 && n.FenceToken >= a.Session.Route.FenceToken
}

// Preparing records that preparation started or reached step.
func (a *Aggregate) Preparing(n Notice, step string, now time.Time) {
	if a.Session.Route.State == RouteReady && step == "" {
		return
	}
	v := a.Session.Route
	v.State, v.Step, v.FailureReason, v.FenceToken = RoutePreparing, step, "", n.FenceToken
	a.setRoute(v, now)
}

// Progress records a preparation step and its opaque event payload.
func (a *Aggregate) Progress(n Notice, step string, payload []byte, now time.Time) {
	a.Preparing(n, step, now)
	a.emit(Event{Kind: EventProgress, Time: now, Payload: payload})
}

// Ready records a ready route. A wrapper instance other than the one that
// accepted the running work means the agent restarted: that work fails with
// agent_restarted, since the new runtime never saw it.
func (a *Aggregate) Ready(n Notice, runtimeSessionID, wrapperInstance string, now time.Time) {
	old := a.Session.Route.WrapperInstance
	if old != "" && wrapperInstance != "" && old != wrapperInstance {
		a.failWhere(isAccepted, MessageFailed, ReasonAgentRestarted, now)
	}
	v := RouteView{
		State: RouteReady, RuntimeSessionID: runtimeSessionID,
		WrapperInstance: wrapperInstance, FenceToken: n.FenceToken,
		AgentProfile: a.Session.Agent.Profile, AgentModel: a.Session.Agent.Model,
	}
	if v.WrapperInstance == "" {
		v.WrapperInstance = old
	}
	a.setRoute(v, now)
}

// SawRuntimeSession records a runtime session id the sandbox named for the
// route (in a synchronous view, before any ready notification), so that
// deletion tombstones its history too.
func (a *Aggregate) SawRuntimeSession(id string, now time.Time) {
	if a.Session.recordRuntimeSession(id) {
		a.touch(now)
	}
}

// Reconnecting records a dropped wrapper stream that may come back; work is kept.
func (a *Aggregate) Reconnecting(n Notice, now time.Time) {
	v := a.Session.Route
	v.State, v.Step, v.FenceToken = RouteReconnecting, "", n.FenceToken
	a.setRoute(v, now)
}

// Failed records a failed preparation: queued and accepted work fails.
// A preparation the suspend stopped is a route lost to it (Lost).
func (a *Aggregate) Failed(n Notice, reason string, now time.Time) {
	if reason == ReasonSuspend {
		a.Lost(n, reason, now)
		return
	}
	a.failWhere(isActive, MessageFailed, ReasonRouteFailed, now)
	v := a.Session.Route
	v.State, v.Step, v.FailureReason, v.FenceToken = RouteFailed, "", reason, n.FenceToken
	a.setRoute(v, now)
}

// Lost records a lost route: accepted work fails (with the sandbox's limit
// when one stopped it: the session is told which); the caller prepares
// again when work is still queued (the returned bool).
func (a *Aggregate) Lost(n Notice, reason string, now time.Time) (reprepare bool) {
	msg := ReasonRouteLost
	if reason == ReasonMemoryLimit || reason == ReasonDiskQuota {
		msg = reason
	}
	a.failWhere(isAccepted, MessageFailed, msg, now)
	v := a.Session.Route
	if reason == ReasonSuspend && v.State == RouteSuspended {
		// A late notice of the stop this suspend already verified.
		return len(a.Queued()) > 0
	}
	// A route lost to a suspend is not suspended yet: the sandbox asked
	// its runtime to stop and has not seen it gone. Only Suspended, once
	// the suspend verified the absence, says so (DESIGN.md 3.8).
	v.State, v.Step, v.FenceToken = RouteUnknown, "", n.FenceToken
	a.setRoute(v, now)
	return len(a.Queued()) > 0
}

// Busy says whether the session has queued or accepted work.
func (a *Aggregate) Busy() bool { return slices.ContainsFunc(a.Active, isActive) }

// BeginSuspend checks that the session may be suspended: queued or
// accepted work refuses it (ErrTurnRunning) unless force, which cancels
// that work; abort says a turn was running (an abort should be sent).
func (a *Aggregate) BeginSuspend(force bool, now time.Time) (abort bool, err error) {
	if a.Session.State == StateDeleting || a.Intent != nil {
		return false, ErrSessionNotFound
	}
	if !slices.ContainsFunc(a.Active, isActive) {
		return false, nil
	}
	if !force {
		return false, ErrTurnRunning
	}
	abort = a.HasAccepted()
	a.failWhere(isActive, MessageCancelled, "", now)
	return abort, nil
}

// Suspended records a suspended route: its runtime's absence is verified.
// Work sent since the suspend began leaves it as it is: the drain that
// message kicked prepares the route again.
func (a *Aggregate) Suspended(now time.Time) {
	if slices.ContainsFunc(a.Active, isActive) {
		return
	}
	v := a.Session.Route
	v.State, v.Step, v.FailureReason = RouteSuspended, "", ""
	a.setRoute(v, now)
}

// TurnResult is how a turn ended.
type TurnResult int

const (
	TurnSucceeded TurnResult = iota + 1
	TurnFailed
	TurnCancelled
)

// Outcome settles every accepted message up to and including lastMessageID
// (by queue position), and every such message still queued: the outcome
// proves it was delivered, by a replica that died before it recorded the
// acceptance (left queued, it would wait for the backstop, and its
// redelivery would only bring back this turn's id). A repeated turn id (already in Seen) or an unknown
// last message settles nothing; late outcomes for terminal messages are
// ignored because terminal states are final. The payload is recorded once.
//
// An unknown last message does not record the turn id either: the message
// may be one Redis lost in a failover after it had been delivered, which
// its caller's retry stores again and the runtime answers again under the
// same turn id (turn ids derive from message ids); recorded, that answer
// would be taken for a repeat and the message would wait for its backstop.
//
// The outcome takes the usage counted since the previous one; withUsage
// (when not nil) encodes the payload with it.
func (a *Aggregate) Outcome(turnID, lastMessageID string, result TurnResult, reason string, payload []byte, withUsage func(Usage) []byte, now time.Time) {
	if a.Seen[turnID] {
		return
	}
	if lastMessageID != "" && (a.Lookup == nil || a.Lookup.ID != lastMessageID) {
		return
	}
	a.seenAdded = append(a.seenAdded, turnID)
	if u := a.TakeTurnUsage(); !u.IsZero() && withUsage != nil {
		payload = withUsage(u)
	}
	a.emit(Event{Kind: EventOutcome, Time: now, Payload: payload})
	var upTo uint64
	if a.Lookup != nil {
		upTo = a.Lookup.Seq
	}
	a.endTurn(upTo, now)
	st, r := MessageCompleted, ""
	switch result {
	case TurnFailed:
		st, r = MessageFailed, reason
		if r == "" {
			r = ReasonTurnFailed
		}
	case TurnCancelled:
		st = MessageCancelled
	}
	a.failWhere(func(m *Message) bool {
		return (m.State == MessageAccepted || m.State == MessageQueued) && m.Seq <= upTo
	}, st, r, now)
}

// Backstops bound every wait: queued longer than queuedFor fails with
// preparation_timeout, accepted longer than acceptedFor with no_outcome.
// A message queued longer than Redrive (when set) makes its session due
// at every sweep until it leaves queued: the drain that delivers it lives
// only in the replica that queued it, which may have died in between.
type Backstops struct {
	QueuedFor   time.Duration
	AcceptedFor time.Duration
	Redrive     time.Duration
}

// Stalled reports whether a has a message queued longer than Redrive.
func (b Backstops) Stalled(a *Aggregate, now time.Time) bool {
	if b.Redrive <= 0 {
		return false
	}
	for _, m := range a.Active {
		if m.State == MessageQueued && now.Sub(m.CreateTime) > b.Redrive {
			return true
		}
	}
	return false
}

// Apply fails overdue messages and returns how many it failed.
func (b Backstops) Apply(a *Aggregate, now time.Time) int {
	n := a.failWhere(func(m *Message) bool {
		return m.State == MessageQueued && now.Sub(m.CreateTime) > b.QueuedFor
	}, MessageFailed, ReasonPreparationTimeout, now)
	n += a.failWhere(func(m *Message) bool {
		return m.State == MessageAccepted && now.Sub(m.AcceptTime) > b.AcceptedFor
	}, MessageFailed, ReasonNoOutcome, now)
	return n
}

// NextDeadline is the earliest time a backstop may fire for a's active
// messages (zero when none is active): the sweeper's schedule.
func (b Backstops) NextDeadline(a *Aggregate) time.Time {
	var next time.Time
	for _, m := range a.Active {
		var d time.Time
		switch m.State {
		case MessageQueued:
			d = m.CreateTime.Add(b.QueuedFor)
			if b.Redrive > 0 && b.Redrive < b.QueuedFor {
				d = m.CreateTime.Add(b.Redrive)
			}
		case MessageAccepted:
			d = m.AcceptTime.Add(b.AcceptedFor)
		default:
			continue
		}
		if next.IsZero() || d.Before(next) {
			next = d
		}
	}
	return next
}

// BeginDeletion persists a deletion intent (once) and marks the session
// deleting; from then on the session takes no new work.
func (a *Aggregate) BeginDeletion(reason string, now time.Time) *DeletionIntent {
	if a.Intent == nil {
		in := NewDeletionIntent(&a.Session, reason, now)
		a.Intent, a.intentChanged = &in, true
	}
	if a.Session.State != StateDeleting {
		a.Session.State = StateDeleting
		a.touch(now)
		a.emitSession(now)
	}
	return a.Intent
}
