// Package store keeps sessions in Redis.
//
// Keys (every key of one session carries the {ses/<id>} hash tag, the
// session's pkg/fence resource, so a session's transaction and scripts touch
// one Redis Cluster slot):
//
//	ses:{ses/id}:meta     JSON session record
//	ses:{ses/id}:msgs     hash message id → JSON message state (no content)
//	ses:{ses/id}:content  hash message id → message text
//	ses:{ses/id}:order    zset seq → message id (every message, queue order)
//	ses:{ses/id}:active   zset seq → message id (queued and accepted only)
//	ses:{ses/id}:events   stream: the event log (MAXLEN ~ EventCap)
//	ses:{ses/id}:seen     set of recorded runtime event ids and turn ids
//	ses:{ses/id}:del      JSON deletion intent
//	ses:{ses/id}:audit    stream: audit records (audit.go), MAXLEN ~ EventCap
//	ses:{ses/id}:auditn   hash: counts of expected egress denials (audit.go)
//	ses:wipe:{ses/id}     wipe locator left after deletion
//	fence:{ses/id}:token, fence:{ses/id}:lease   the deletion reconciler's lease
//
// Indexes (derived, written after the session's transaction; readers
// tolerate stale entries): ses:idx:org:<org> and ses:idx:user:<org>:<user>
// (lexicographic, newest first), ses:idx:active (score: next backstop
// deadline), ses:idx:updated (score: last update), ses:idx:deleting (score:
// next deletion attempt).
//
// Single-writer safety: every change of a session's state is a
// read-modify-write under WATCH on the session's state keys followed by one
// MULTI/EXEC (optimistic concurrency, retried on conflict), so two replicas
// never interleave writes of one session and a transition always sees the
// state it replaces. Runtime events are appended by one Lua script. The
// deletion reconciler, which does slow peer I/O between writes, holds a
// pkg/fence lease on the session and fences every write it makes (intent
// updates, the wipe) with the lease's token, so a paused former reconciler
// cannot write after another took over.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/replication"
	"agentplane.dev/services/session/internal/session"
)

const (
	idxActive   = "ses:idx:active"
	idxUpdated  = "ses:idx:updated"
	idxDeleting = "ses:idx:deleting"
	// idxSuspend schedules idle runtimes' suspends: each session whose
	// route is ready with no work, at the time its suspend is due
	// (session.SuspendPolicy.Due); a claim moves it a lease later.
	idxSuspend = "ses:idx:suspend"
	// idxStates counts sessions per live state (active, stopped), moved in
	// the same write as each state change (schedule.write); sessions with
	// a deletion intent are the members of idxDeleting.
	idxStates  = "ses:idx:states"
	maxRetries = 100
)

// Resource is the session's pkg/fence resource, "ses/<id>": every service
// prefixes its fence resources, so no caller-chosen id of another service
// (a sandbox id equal to a session id) can name this session's lease or
// token. Every key of the session carries it as its hash tag.
func Resource(id string) string { return "ses/" + id }

func key(id, suffix string) string { return "ses:" + fence.Key(Resource(id), suffix) }

// WipeLocatorKey is the key left behind by a wiped session.
func WipeLocatorKey(id string) string { return "ses:wipe:{" + Resource(id) + "}" }

func orgIndex(org string) string        { return "ses:idx:org:" + org }
func userIndex(org, user string) string { return "ses:idx:user:" + org + ":" + user }

// indexMember sorts newest first under ZRANGEBYLEX.
func indexMember(created time.Time, id string) string {
	return fmt.Sprintf("%016x:%s", uint64(math.MaxInt64-created.UnixNano()), id)
}

// Store is the session service's Redis access.
type Store struct {
	rdb      redis.UniversalClient
	eventCap int64
	deadline func(*session.Aggregate) time.Time
	suspend  func(*session.Aggregate) time.Time // zero: not scheduled
	cluster  bool
	recent   recentStates
}

// New returns a store; eventCap bounds each session's event log (approximate
// trim) and deadline says when a session's next backstop is due (zero: no
// active work), for the backstop schedule.
func New(rdb redis.UniversalClient, eventCap int64, deadline func(*session.Aggregate) time.Time) *Store {
	_, cluster := rdb.(*redis.ClusterClient)
	return &Store{rdb: rdb, eventCap: eventCap, deadline: deadline, cluster: cluster, recent: newRecentStates(),
		suspend: func(*session.Aggregate) time.Time { return time.Time{} }}
}

// ScheduleSuspends makes every change write when the session's idle
// runtime is to be suspended (due; zero: not), for ClaimDueSuspends. Call
// before the store is used.
func (s *Store) ScheduleSuspends(due func(*session.Aggregate) time.Time) { s.suspend = due }

// Load says what Update loads besides the session and its active messages.
type Load struct {
	MessageID string   // load this message into Aggregate.Lookup
	SeenIDs   []string // report which of these dedup ids are recorded
	Content   bool     // load the text of active messages too (for delivery)
}

// Update loads the session's aggregate, runs fn and writes what fn changed,
// atomically. fn may run more than once (on a concurrent write it is retried
// with fresh state), so it must not do I/O. A missing session is
// session.ErrSessionNotFound. The schedules (backstop deadline, last update)
// are written in the same transaction on a single Redis; on Cluster, where
// they live in other slots, right after it.
//
// On a single Redis, when this process committed the session's last state
// it knows, fn first runs on that state and one script writes the change
// only if the stored state is still exactly that one (one round trip; see
// commitRecent). Otherwise, or when that state turns out stale, a change
// costs two round trips: WATCH travels in one pipeline with the load script,
// then MULTI/EXEC (which also ends the watch, so no UNWATCH follows unless
// fn refused the change).
func (s *Store) Update(ctx context.Context, id string, load Load, fn func(*session.Aggregate) error) (*session.Aggregate, error) {
	_, single := s.rdb.(*redis.Client)
	if single {
		if a, done, err := s.commitRecent(ctx, id, load, fn); done {
			return a, err
		}
	}
	u := &update{s: s, id: id, load: load, fn: fn, single: single}
	u.watched = []string{key(id, "meta"), key(id, "del"), key(id, "active")}
	if load.MessageID != "" {
		u.watched = append(u.watched, key(id, "order"))
	}
	txf := func(tx *redis.Tx) error { return u.attempt(ctx, tx) }
	for range maxRetries {
		u.out = nil
		var err error
		if single {
			err = s.rdb.Watch(ctx, txf) // WATCH goes out with the load
		} else {
			err = s.rdb.Watch(ctx, txf, u.watched...)
		}
		if errors.Is(err, redis.TxFailedErr) {
			continue
		}
		if err == nil {
			err = u.committed(ctx)
		}
		return u.out, err
	}
	return nil, session.ErrConflictRetries
}

// update is one Update's optimistic transaction: what it watches, and what
// its latest attempt read and wrote, which outlives the attempt's retry.
type update struct {
	s      *Store
	id     string
	load   Load
	fn     func(*session.Aggregate) error
	single bool // a single Redis: WATCH goes out with the load, and a committed state is remembered

	watched      []string
	out          *session.Aggregate // the state fn made; nil until fn succeeded
	st           stored             // the stored form of out
	sched        schedule
	wroteNothing bool // fn changed nothing (an idempotent replay)
}

// attempt is one WATCH, load, fn, MULTI/EXEC; a watched key changed by
// another writer fails EXEC with redis.TxFailedErr.
func (u *update) attempt(ctx context.Context, tx *redis.Tx) (err error) {
	s := u.s
	var pipelined []string
	if u.single {
		pipelined = u.watched
		defer func() {
			// EXEC ran (committed, aborted on a watched key, or discarded): the watch is gone.
			released := u.out != nil && (err == nil || errors.Is(err, redis.TxFailedErr) || redis.IsExecAbortError(err))
			if !released {
				_ = tx.Unwatch(ctx).Err() // never leave a watch on a pooled connection
			}
		}()
	}
	a, loaded, err := s.load(ctx, tx, u.id, u.load, pipelined)
	if err != nil {
		return err
	}
	before, prevUpdate, from := s.deadline(a), a.Session.UpdateTime, a.Session.State
	suspendBefore := s.suspend(a)
	if err := u.fn(a); err != nil {
		return err
	}
	u.out, u.st = a, loaded
	cmds, err := s.write(a, &u.st)
	if err != nil {
		return err
	}
	u.sched = s.scheduleAfter(a, before, prevUpdate, from)
	u.sched.suspendAfter(s, suspendBefore)
	if !s.cluster {
		u.sched.write(&cmds)
	}
	u.wroteNothing = len(cmds) == 0
	_, err = tx.TxPipelined(ctx, cmds.queue(ctx))
	return err
}

// committed finishes a committed update: on Cluster it writes the schedules,
// which live in other slots; a replay confirms what it acknowledges; on a
// single Redis the state is remembered for commitRecent.
func (u *update) committed(ctx context.Context) error {
	s := u.s
	if s.cluster {
		if u.wroteNothing {
			// A replay: the attempt that wrote may have failed between
			// its transaction and this pipeline (a master killed), and
			// its messages would be in no sweep's schedule: no redrive,
			// no backstop. The deadline is absolute: rewriting is safe.
			u.sched.deadlineChanged = true
			u.sched.suspendChanged = true
		}
		var cmds commands
		u.sched.write(&cmds)
		if _, err := s.rdb.Pipelined(ctx, cmds.queue(ctx)); err != nil {
			return err
		}
	}
	if u.wroteNothing {
		// What the replay acknowledges may be an earlier attempt's unconfirmed write.
		if err := replication.Confirm(ctx, s.rdb, key(u.id, "meta")); err != nil {
			return err
		}
	}
	if u.single {
		s.recent.remember(u.out, u.st)
	}
	return nil
}

// scheduleAfter says which schedule entries a change of a moves; before,
// prevUpdate and from are the backstop deadline, update time and state it
// was loaded with.
func (s *Store) scheduleAfter(a *session.Aggregate, before, prevUpdate time.Time, from session.State) schedule {
	sched := schedule{a: a, deadline: s.deadline(a), from: from}
	sched.deadlineChanged = !sched.deadline.Equal(before)
	// Retention needs day precision: refresh the index at most once a minute.
	sched.updateChanged = a.Session.UpdateTime.Sub(prevUpdate) >= time.Minute || a.IntentChanged()
	return sched
}

// loadScript reads what a transition needs in one round trip: the record,
// the deletion intent, the active messages' states (and texts when ARGV[1]
// is "1"), one looked-up message (ARGV[2], may be empty) and which dedup
// ids (ARGV[3...]) are recorded. It writes nothing, so it may run between
// WATCH and MULTI. A missing record returns nil.
//
// KEYS: meta, del, active, msgs, content, seen.
var loadScript = redis.NewScript(`
local meta = redis.call('GET', KEYS[1])
if not meta then return false end
local function hmget(k, ids)
  local out = {}
  for i = 1, #ids, 1000 do
    local part = redis.call('HMGET', k, unpack(ids, i, math.min(i + 999, #ids)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end
local ids = redis.call('ZRANGE', KEYS[3], 0, -1)
local states, texts = {}, {}
if #ids > 0 then
  states = hmget(KEYS[4], ids)
  if ARGV[1] == '1' then texts = hmget(KEYS[5], ids) end
end
local lookup = false
if ARGV[2] ~= '' then lookup = redis.call('HGET', KEYS[4], ARGV[2]) end
local seen = {}
if #ARGV > 2 then seen = redis.call('SMISMEMBER', KEYS[6], unpack(ARGV, 3)) end
return {meta, redis.call('GET', KEYS[2]), ids, states, texts, lookup, seen}
`)

// load reads the aggregate with loadScript, and the stored form of its
// record and active messages; watch, when set, is WATCHed in the same
// pipeline (tx must then be a transaction's connection).
func (s *Store) load(ctx context.Context, tx redis.Cmdable, id string, load Load, watch []string) (*session.Aggregate, stored, error) {
	reply, err := runLoadScript(ctx, tx, id, load, watch)
	if err != nil {
		return nil, stored{}, err
	}
	return decodeLoad(id, load, reply)
}

// runLoadScript runs loadScript for the session, after WATCH in one pipeline
// when watch is set, and returns its reply: a missing session is
// session.ErrSessionNotFound.
func runLoadScript(ctx context.Context, tx redis.Cmdable, id string, load Load, watch []string) ([]any, error) {
	keys := []string{key(id, "meta"), key(id, "del"), key(id, "active"), key(id, "msgs"), key(id, "content"), key(id, "seen")}
	args := make([]any, 0, 2+len(load.SeenIDs))
	content := "0"
	if load.Content {
		content = "1"
	}
	args = append(args, content, load.MessageID)
	for _, v := range load.SeenIDs {
		args = append(args, v)
	}
	run := func(eval func(p redis.Pipeliner) *redis.Cmd) (*redis.Cmd, error) {
		if len(watch) == 0 {
			cmd := eval(nil)
			return cmd, cmd.Err()
		}
		pipe := tx.Pipeline()
		w := make([]any, 0, 1+len(watch))
		w = append(w, "watch")
		for _, k := range watch {
			w = append(w, k)
		}
		pipe.Do(ctx, w...)
		cmd := eval(pipe)
		_, err := pipe.Exec(ctx)
		return cmd, err
	}
	on := func(p redis.Pipeliner) redis.Scripter {
		if p == nil {
			return tx
		}
		return p
	}
	// EVALSHA_RO: the script only reads, so the replication hook
	// (pkg/replication) does not pay a marker write and a WAIT for it, and a
	// read serves while the replicas cannot confirm writes.
	cmd, err := run(func(p redis.Pipeliner) *redis.Cmd { return loadScript.EvalShaRO(ctx, on(p), keys, args...) })
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		// First use on this server (or after a restart): send the body once.
		cmd, err = run(func(p redis.Pipeliner) *redis.Cmd { return loadScript.EvalRO(ctx, on(p), keys, args...) })
	}
	if errors.Is(err, redis.Nil) {
		return nil, session.ErrSessionNotFound
	} else if err != nil {
		return nil, err
	}
	reply, ok := cmd.Val().([]any)
	if !ok || len(reply) != 7 {
		return nil, fmt.Errorf("session %s: unexpected load reply %T", id, cmd.Val())
	}
	return reply, nil
}

// decodeLoad decodes loadScript's reply into the aggregate and the stored
// form of its record and active messages.
func decodeLoad(id string, load Load, res []any) (*session.Aggregate, stored, error) {
	metaRaw, _ := res[0].(string)
	a := &session.Aggregate{Seen: map[string]bool{}}
	if err := json.Unmarshal([]byte(metaRaw), &a.Session); err != nil {
		return nil, stored{}, fmt.Errorf("session %s: corrupt record: %w", id, err)
	}
	if raw, ok := res[1].(string); ok {
		a.Intent = new(session.DeletionIntent)
		if err := json.Unmarshal([]byte(raw), a.Intent); err != nil {
			return nil, stored{}, fmt.Errorf("session %s: corrupt deletion intent: %w", id, err)
		}
	}
	ids, _ := res[2].([]any)
	states, _ := res[3].([]any)
	texts, _ := res[4].([]any)
	if len(states) != len(ids) || load.Content && len(texts) != len(ids) {
		return nil, stored{}, fmt.Errorf("session %s: unexpected load reply", id)
	}
	st := stored{meta: metaRaw, states: make(map[*session.Message]string, len(states)+1)}
	for i, v := range states {
		str, ok := v.(string)
		if !ok {
			return nil, stored{}, fmt.Errorf("session %s: active message %v has no record", id, ids[i])
		}
		m := new(session.Message)
		if err := json.Unmarshal([]byte(str), m); err != nil {
			return nil, stored{}, fmt.Errorf("session %s: corrupt message: %w", id, err)
		}
		if load.Content {
			m.Content, _ = texts[i].(string)
		}
		a.Active = append(a.Active, m)
		st.states[m] = str
	}
	if raw, ok := res[5].(string); ok {
		a.Lookup = new(session.Message)
		if err := json.Unmarshal([]byte(raw), a.Lookup); err != nil {
			return nil, stored{}, fmt.Errorf("session %s: corrupt message: %w", id, err)
		}
	}
	seen, _ := res[6].([]any)
	for i, v := range seen {
		if n, _ := v.(int64); n == 1 && i < len(load.SeenIDs) {
			a.Seen[load.SeenIDs[i]] = true
		}
	}
	return a, st, nil
}

// commands are the writes of one change, each a command's arguments; they
// run in MULTI/EXEC or inside commitScript.
type commands [][]any

func (c *commands) add(args ...any) { *c = append(*c, args) }

// queue sends the commands into a pipeline (or a MULTI/EXEC).
func (c commands) queue(ctx context.Context) func(redis.Pipeliner) error {
	return func(p redis.Pipeliner) error {
		for _, args := range c {
			p.Do(ctx, args...)
		}
		return nil
	}
}

// stored is the exact stored form of a state: the record, and the state of
// each active message (without text).
type stored struct {
	meta   string
	states map[*session.Message]string
}

// write returns the commands that store what a changed, and records the
// stored form of what it writes in st.
func (s *Store) write(a *session.Aggregate, st *stored) (commands, error) {
	id := a.Session.ID
	var cmds commands
	if a.SessionChanged() {
		raw, err := json.Marshal(&a.Session)
		if err != nil {
			return nil, err
		}
		cmds.add("set", key(id, "meta"), raw)
		st.meta = string(raw)
	}
	if a.IntentChanged() {
		raw, err := json.Marshal(a.Intent)
		if err != nil {
			return nil, err
		}
		cmds.add("set", key(id, "del"), raw)
	}
	changed := a.Changed()
	raws := make([][]byte, len(changed))
	for i, m := range changed {
		raw, err := json.Marshal(m)
		if err != nil {
			return nil, err
		}
		raws[i] = raw
		cmds.add("hset", key(id, "msgs"), m.ID, raw)
		if st.states != nil {
			st.states[m] = string(raw)
		}
		if m.Content != "" {
			cmds.add("hset", key(id, "content"), m.ID, m.Content)
			cmds.add("zadd", key(id, "order"), m.Seq, m.ID)
		}
		if m.State.Terminal() {
			cmds.add("zrem", key(id, "active"), m.ID)
		} else {
			cmds.add("zadd", key(id, "active"), m.Seq, m.ID)
		}
	}
	if ids := a.SeenAdded(); len(ids) > 0 {
		args := make([]any, 0, 2+len(ids))
		args = append(args, "sadd", key(id, "seen"))
		for _, v := range ids {
			args = append(args, v)
		}
		cmds.add(args...)
	}
	for _, e := range a.Events() {
		var kind string
		var v []byte
		var err error
		if i := storedAs(changed, e.Message); i >= 0 {
			kind, v = string(e.Kind), raws[i] // the event's snapshot is the message as stored
		} else if kind, v, err = encodeEvent(e); err != nil {
			return nil, err
		}
		cmds.add("xadd", key(id, "events"), "maxlen", "~", s.eventCap, "*", "k", kind, "t", e.Time.UnixMilli(), "v", v)
	}
	return cmds, nil
}

// storedAs is the index of the changed message whose stored state equals
// snap (a message event's snapshot), or -1.
func storedAs(changed []*session.Message, snap *session.Message) int {
	if snap == nil {
		return -1
	}
	for i, m := range changed {
		if m.ID == snap.ID {
			c := *m
			c.Content = ""
			if c == *snap {
				return i
			}
		}
	}
	return -1
}

// Read loads the session's aggregate without changing it.
func (s *Store) Read(ctx context.Context, id string, load Load) (*session.Aggregate, error) {
	a, _, err := s.load(ctx, s.rdb, id, load, nil)
	return a, err
}

// Create stores a new session, or calls same with the stored one when the id
// exists (same request → nil, else an error). An id under deletion is a
// *session.DeletionPendingError.
func (s *Store) Create(ctx context.Context, sess *session.Session, same func(*session.Session) error) (*session.Session, bool, error) {
	id := sess.ID
	var stored *session.Session
	created := false
	for range maxRetries {
		err := s.rdb.Watch(ctx, func(tx *redis.Tx) error {
			if n, err := tx.Exists(ctx, key(id, "del")).Result(); err != nil {
				return err
			} else if n > 0 {
				return &session.DeletionPendingError{RetryAfter: time.Second, Step: "deleting"}
			}
			raw, err := tx.Get(ctx, key(id, "meta")).Bytes()
			if err == nil {
				stored = new(session.Session)
				if err := json.Unmarshal(raw, stored); err != nil {
					return err
				}
				return same(stored)
			} else if !errors.Is(err, redis.Nil) {
				return err
			}
			raw, err = json.Marshal(sess)
			if err != nil {
				return err
			}
			_, err = tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
				p.Set(ctx, key(id, "meta"), raw, 0)
				if !s.cluster { // on Cluster the count lives in another slot: right after
					p.HIncrBy(ctx, idxStates, string(sess.State), 1)
				}
				return nil
			})
			stored, created = sess, true
			return err
		}, key(id, "meta"), key(id, "del"))
		if errors.Is(err, redis.TxFailedErr) {
			continue
		}
		if err == nil && !created {
			// The session may be an earlier attempt's unconfirmed write.
			err = replication.Confirm(ctx, s.rdb, key(id, "meta"))
		}
		if err != nil {
			return nil, false, err
		}
		if created {
			member := indexMember(sess.CreateTime, id)
			_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				p.ZAdd(ctx, orgIndex(sess.OrgID), redis.Z{Member: member})
				p.ZAdd(ctx, userIndex(sess.OrgID, sess.UserID), redis.Z{Member: member})
				p.ZAdd(ctx, idxUpdated, redis.Z{Score: float64(sess.UpdateTime.UnixMilli()), Member: id})
				if s.cluster {
					p.HIncrBy(ctx, idxStates, string(sess.State), 1)
				}
				return nil
			})
		}
		return stored, created, err
	}
	return nil, false, session.ErrConflictRetries
}

// Get returns a session.
func (s *Store) Get(ctx context.Context, id string) (*session.Session, error) {
	raw, err := s.rdb.Get(ctx, key(id, "meta")).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, session.ErrSessionNotFound
	} else if err != nil {
		return nil, err
	}
	sess := new(session.Session)
	return sess, json.Unmarshal(raw, sess)
}

// Live reports whether the session record exists and takes work (no
// deletion intent).
func (s *Store) Live(ctx context.Context, id string) (bool, error) {
	var meta, del *redis.IntCmd
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		meta = p.Exists(ctx, key(id, "meta"))
		del = p.Exists(ctx, key(id, "del"))
		return nil
	})
	if err != nil {
		return false, err
	}
	return meta.Val() == 1 && del.Val() == 0, nil
}

// GetMessage returns a message with its content.
func (s *Store) GetMessage(ctx context.Context, id, msgID string) (*session.Message, error) {
	var state, content *redis.StringCmd
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		state = p.HGet(ctx, key(id, "msgs"), msgID)
		content = p.HGet(ctx, key(id, "content"), msgID)
		return nil
	})
	if errors.Is(err, redis.Nil) {
		return nil, session.ErrMessageNotFound
	} else if err != nil {
		return nil, err
	}
	m := new(session.Message)
	if err := json.Unmarshal([]byte(state.Val()), m); err != nil {
		return nil, err
	}
	m.Content = content.Val()
	return m, nil
}

// ListMessages returns up to n messages after queue position afterSeq, with
// content, and whether more follow.
func (s *Store) ListMessages(ctx context.Context, id string, afterSeq uint64, n int) ([]*session.Message, bool, error) {
	ids, err := s.rdb.ZRangeByScore(ctx, key(id, "order"), &redis.ZRangeBy{
		Min: "(" + strconv.FormatUint(afterSeq, 10), Max: "+inf", Count: int64(n + 1),
	}).Result()
	if err != nil || len(ids) == 0 {
		return nil, false, err
	}
	more := len(ids) > n
	ids = ids[:min(n, len(ids))]
	var states, contents *redis.SliceCmd
	_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		states = p.HMGet(ctx, key(id, "msgs"), ids...)
		contents = p.HMGet(ctx, key(id, "content"), ids...)
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	out := make([]*session.Message, 0, len(ids))
	for i, v := range states.Val() {
		str, ok := v.(string)
		if !ok {
			continue
		}
		m := new(session.Message)
		if err := json.Unmarshal([]byte(str), m); err != nil {
			return nil, false, err
		}
		m.Content, _ = contents.Val()[i].(string)
		out = append(out, m)
	}
	return out, more, nil
}

// ListSessions returns up to n sessions of org (and user when set), newest
// first, after the page cursor (an index member), plus the next cursor.
func (s *Store) ListSessions(ctx context.Context, org, user, after string, n int) ([]*session.Session, string, error) {
	idx := orgIndex(org)
	if user != "" {
		idx = userIndex(org, user)
	}
	min := "-"
	if after != "" {
		min = "(" + after
	}
	var out []*session.Session
	for len(out) < n {
		members, err := s.rdb.ZRangeByLex(ctx, idx, &redis.ZRangeBy{Min: min, Max: "+", Count: int64(n - len(out))}).Result()
		if err != nil {
			return nil, "", err
		}
		if len(members) == 0 {
			return out, "", nil
		}
		cmds := make([]*redis.StringCmd, len(members))
		_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, m := range members {
				cmds[i] = p.Get(ctx, key(memberID(m), "meta"))
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, "", err
		}
		for _, c := range cmds {
			raw, err := c.Bytes()
			if err != nil {
				continue // wiped after indexing
			}
			sess := new(session.Session)
			if err := json.Unmarshal(raw, sess); err != nil {
				return nil, "", err
			}
			out = append(out, sess)
		}
		min = "(" + members[len(members)-1]
	}
	// One look ahead decides whether a next page exists.
	more, err := s.rdb.ZRangeByLex(ctx, idx, &redis.ZRangeBy{Min: min, Max: "+", Count: 1}).Result()
	if err != nil || len(more) == 0 {
		return out, "", err
	}
	return out, min[1:], nil
}

func memberID(m string) string {
	if len(m) > 17 {
		return m[17:]
	}
	return m
}

// ValidPageCursor reports whether c can be a ListSessions cursor.
func ValidPageCursor(c string) bool {
	if len(c) < 18 || c[16] != ':' {
		return false
	}
	if _, err := strconv.ParseUint(c[:16], 16, 64); err != nil {
		return false
	}
	return len(session.CheckID("id", c[17:])) == 0
}

// schedule is a session's entries in the backstop, retention and deletion
// indexes after a change.
type schedule struct {
	a                              *session.Aggregate
	deadline                       time.Time
	deadlineChanged, updateChanged bool
	from                           session.State
	suspend                        time.Time // when the idle runtime is to be suspended; zero: not
	suspendChanged                 bool
}

// suspendAfter sets the suspend entry from a's state after the change;
// before is the due time a was loaded with.
func (sc *schedule) suspendAfter(s *Store, before time.Time) {
	sc.suspend = s.suspend(sc.a)
	sc.suspendChanged = !sc.suspend.Equal(before)
}

func (sc schedule) write(cmds *commands) {
	id := sc.a.Session.ID
	if sc.deadlineChanged {
		if sc.deadline.IsZero() {
			cmds.add("zrem", idxActive, id)
		} else {
			cmds.add("zadd", idxActive, sc.deadline.UnixMilli(), id)
		}
	}
	if sc.suspendChanged {
		if sc.suspend.IsZero() {
			cmds.add("zrem", idxSuspend, id)
		} else {
			cmds.add("zadd", idxSuspend, sc.suspend.UnixMilli(), id)
		}
	}
	if sc.updateChanged {
		cmds.add("zadd", idxUpdated, sc.a.Session.UpdateTime.UnixMilli(), id)
	}
	if sc.a.IntentChanged() {
		cmds.add("zadd", idxDeleting, sc.a.Intent.NextAttempt.UnixMilli(), id)
	}
	if to := sc.a.Session.State; to != sc.from {
		if counted(sc.from) {
			cmds.add("hincrby", idxStates, string(sc.from), -1)
		}
		if counted(to) {
			cmds.add("hincrby", idxStates, string(to), 1)
		}
	}
}

// counted says whether idxStates counts a state (deleting is idxDeleting's).
func counted(st session.State) bool {
	return st == session.StateActive || st == session.StateStopped
}

// StateCounts returns how many sessions are in each state: active and
// stopped from idxStates, deleting (a deletion intent not yet wiped) from
// idxDeleting.
func (s *Store) StateCounts(ctx context.Context) (map[session.State]int64, error) {
	var states *redis.MapStringStringCmd
	var deleting *redis.IntCmd
	if _, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		states = p.HGetAll(ctx, idxStates)
		deleting = p.ZCard(ctx, idxDeleting)
		return nil
	}); err != nil {
		return nil, err
	}
	out := map[session.State]int64{session.StateActive: 0, session.StateStopped: 0, session.StateDeleting: deleting.Val()}
	for k, v := range states.Val() {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("session state count %s: %w", k, err)
		}
		if counted(session.State(k)) {
			out[session.State(k)] = n
		}
	}
	return out, nil
}

// DueActive returns up to n sessions whose backstop deadline is ≤ now.
func (s *Store) DueActive(ctx context.Context, now time.Time, n int) ([]string, error) {
	return s.due(ctx, idxActive, now, n)
}

// DueDeletions returns up to n deletions whose next attempt is ≤ now.
func (s *Store) DueDeletions(ctx context.Context, now time.Time, n int) ([]string, error) {
	return s.due(ctx, idxDeleting, now, n)
}

// Idle returns up to n sessions not updated since before.
func (s *Store) Idle(ctx context.Context, before time.Time, n int) ([]string, error) {
	return s.due(ctx, idxUpdated, before, n)
}

func (s *Store) due(ctx context.Context, idx string, t time.Time, n int) ([]string, error) {
	return s.rdb.ZRangeByScore(ctx, idx, &redis.ZRangeBy{
		Min: "-inf", Max: strconv.FormatInt(t.UnixMilli(), 10), Count: int64(n),
	}).Result()
}

// Unindex drops a session from the backstop and retention schedules (its
// record is gone or it is being deleted).
func (s *Store) Unindex(ctx context.Context, id string) error {
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.ZRem(ctx, idxActive, id)
		p.ZRem(ctx, idxUpdated, id)
		p.ZRem(ctx, idxSuspend, id)
		return nil
	})
	return err
}

// claimSuspendsScript claims up to ARGV[2] sessions whose suspend is due
// (score ≤ ARGV[1]) by moving each to ARGV[3], a lease later: one step,
// so two replicas never claim the same session, and a replica that dies
// holding a claim leaves it due again when the lease ends. KEYS: idxSuspend.
var claimSuspendsScript = redis.NewScript(`
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], ARGV[3], id) end
return ids
`)

// ClaimDueSuspends returns up to n sessions whose idle runtime's suspend is
// due at now, claimed for lease (their entry moves to now+lease, and any
// change of the session rewrites it from its state).
func (s *Store) ClaimDueSuspends(ctx context.Context, now time.Time, lease time.Duration, n int) ([]string, error) {
	return claimSuspendsScript.Run(ctx, s.rdb, []string{idxSuspend},
		now.UnixMilli(), n, now.Add(lease).UnixMilli()).StringSlice()
}

// SuspendScheduled returns a session's suspend entry (zero: none); for tests.
func (s *Store) SuspendScheduled(ctx context.Context, id string) (time.Time, error) {
	v, err := s.rdb.ZScore(ctx, idxSuspend, id).Result()
	if errors.Is(err, redis.Nil) {
		return time.Time{}, nil
	}
	if err != nil {
		return time.Time{}, err
	}
	return time.UnixMilli(int64(v)), nil
}
