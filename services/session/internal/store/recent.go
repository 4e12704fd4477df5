package store

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/expiring"
	"agentplane.dev/services/session/internal/session"
)

// A session's last state this process committed (or loaded for a change) is
// kept, so the next change of the session can skip the read: fn runs on that
// state and commitScript writes the change only if Redis still holds exactly
// that state, byte for byte — the record, no deletion intent, the same active
// messages in the same order with the same stored states, and the looked-up
// message and dedup ids absent. A fresh load would then return the same
// aggregate, so fn decides as it would have under WATCH. Any difference
// (another replica or process wrote, the session was wiped or deleted) makes
// the script write nothing, and the change runs again the usual way.
//
// Only states a fresh load could equal are kept: no deletion intent, active
// messages without their texts.

// recentMax bounds the kept states (a few KiB each).
const recentMax = 10_000

// recentIdle is how long a state is kept without a change of its session. A
// session's changes come in bursts (send, accept, events, outcome) seconds
// apart, so a state idle for longer is unlikely to be used, and a session
// deleted through another replica would otherwise stay until recentMax
// pushes it out: memory that grows with every session ever served.
const recentIdle = 30 * time.Second

// recentMaxActive keeps states small enough to compare in one script call.
const recentMaxActive = 256

type recentState struct {
	a      *session.Aggregate // the session and its active messages only
	meta   string
	ids    []string // active message ids in queue order
	states []string // stored state of each active message
}

type recentStates struct {
	m   *expiring.Map[string, *recentState]
	now func() time.Time // nil: time.Now
}

// newRecentStates sweeps twice per recentIdle (a pass over at most
// recentMax entries).
func newRecentStates() recentStates {
	return recentStates{m: expiring.New[string, *recentState](expiring.Options{TTL: recentIdle, SweepEvery: recentIdle / 2, Max: recentMax})}
}

func (r *recentStates) clock() time.Time {
	if r.now != nil {
		return r.now()
	}
	return time.Now()
}

// remember keeps a's committed state (st: its stored form).
func (r *recentStates) remember(a *session.Aggregate, st stored) {
	id := a.Session.ID
	if a.Intent != nil || st.meta == "" {
		r.forget(id)
		return
	}
	rs := &recentState{a: &session.Aggregate{Session: a.Session}, meta: st.meta}
	for _, m := range a.Active {
		if m.State.Terminal() {
			continue
		}
		raw, ok := st.states[m]
		if !ok || len(rs.ids) == recentMaxActive {
			r.forget(id)
			return
		}
		c := *m
		c.Content = ""
		rs.a.Active = append(rs.a.Active, &c)
		rs.ids = append(rs.ids, m.ID)
		rs.states = append(rs.states, raw)
	}
	r.m.Put(id, rs, r.clock())
}

func (r *recentStates) forget(id string) { r.m.Delete(id) }

func (r *recentStates) get(id string) *recentState {
	rs, _ := r.m.Get(id, r.clock())
	return rs
}

// fresh is a copy of the kept state as a load of lookup (a message id, may
// be empty) would return it, for fn to change, with the stored form of its
// messages. absent is true when the looked-up message is not among the
// active ones: the commit must then find it missing.
func (rs *recentState) fresh(lookup string) (a *session.Aggregate, st stored, absent bool) {
	a = &session.Aggregate{Session: rs.a.Session, Seen: map[string]bool{}, Active: make([]*session.Message, len(rs.a.Active))}
	st = stored{meta: rs.meta, states: make(map[*session.Message]string, len(rs.a.Active)+1)}
	for i, m := range rs.a.Active {
		c := *m
		a.Active[i] = &c
		st.states[&c] = rs.states[i]
		if m.ID == lookup {
			l := *m // a load decodes the lookup apart from the active copy
			a.Lookup = &l
		}
	}
	return a, st, lookup != "" && a.Lookup == nil
}

// commitScript writes a change if the session is still in the expected
// state; 1 when it wrote, 0 when the state differs (nothing written).
//
// KEYS: meta, del, active, msgs, seen.
// ARGV: expected record, n, n active ids, their n states, looked-up message
// id that must not exist ("" for none), m, m dedup ids that must not be
// recorded; then the commands, each as its argument
// count followed by its arguments.
var commitScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local n = tonumber(ARGV[2])
local ids = redis.call('ZRANGE', KEYS[3], 0, -1)
if #ids ~= n then return 0 end
for i = 1, n do
  if ids[i] ~= ARGV[2 + i] then return 0 end
end
if n > 0 then
  local states = redis.call('HMGET', KEYS[4], unpack(ids))
  for i = 1, n do
    if states[i] ~= ARGV[2 + n + i] then return 0 end
  end
end
local i = 3 + 2 * n
if ARGV[i] ~= '' and redis.call('HEXISTS', KEYS[4], ARGV[i]) == 1 then return 0 end
local m = tonumber(ARGV[i + 1])
if m > 0 then
  for _, v in ipairs(redis.call('SMISMEMBER', KEYS[5], unpack(ARGV, i + 2, i + 1 + m))) do
    if v == 1 then return 0 end
  end
end
i = i + 2 + m
while i <= #ARGV do
  local c = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + c))
  i = i + 1 + c
end
return 1
`)

// commitRecent runs fn on the session's kept state and commits the change
// with commitScript. done is false when there is no kept state, fn refused
// it (its decision may rest on a stale state) or the stored state differs:
// the caller then runs the change on a fresh load. Single Redis only: the
// script also writes the schedules, which live in other slots.
func (s *Store) commitRecent(ctx context.Context, id string, load Load, fn func(*session.Aggregate) error) (out *session.Aggregate, done bool, err error) {
	rs := s.recent.get(id)
	if rs == nil || load.Content {
		return nil, false, nil
	}
	a, st, absent := rs.fresh(load.MessageID)
	before, prevUpdate, from := s.deadline(a), a.Session.UpdateTime, a.Session.State
	suspendBefore := s.suspend(a)
	if err := fn(a); err != nil {
		return nil, false, nil
	}
	cmds, err := s.write(a, &st)
	if err != nil {
		return nil, true, err
	}
	sched := s.scheduleAfter(a, before, prevUpdate, from)
	sched.suspendAfter(s, suspendBefore)
	sched.write(&cmds)

	n := len(rs.ids)
	args := make([]any, 0, 4+2*n+len(load.SeenIDs)+len(cmds)*8)
	args = append(args, rs.meta, n)
	for _, v := range rs.ids {
		args = append(args, v)
	}
	for _, v := range rs.states {
		args = append(args, v)
	}
	mustLack := "" // an active lookup's state is compared with the others
	if absent {
		mustLack = load.MessageID
	}
	args = append(args, mustLack, len(load.SeenIDs))
	for _, v := range load.SeenIDs {
		args = append(args, v)
	}
	for _, c := range cmds {
		args = append(args, len(c))
		args = append(args, c...)
	}
	keys := []string{key(id, "meta"), key(id, "del"), key(id, "active"), key(id, "msgs"), key(id, "seen")}
	wrote, err := commitScript.Run(ctx, s.rdb, keys, args...).Int()
	if err != nil {
		s.recent.forget(id)
		return nil, true, err
	}
	if wrote == 0 {
		s.recent.forget(id)
		return nil, false, nil
	}
	s.recent.remember(a, st)
	return a, true, nil
}
