package store

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/replication"
	"agentplane.dev/services/session/internal/session"
)

// Stream entry fields: k kind, t unix ms, v data (JSON snapshot for domain
// kinds, the API layer's encoded payload for runtime/outcome/progress).
func encodeEvent(e session.Event) (kind string, v []byte, err error) {
	switch e.Kind {
	case session.EventRoute:
		v, err = json.Marshal(e.Route)
	case session.EventMessage:
		v, err = json.Marshal(e.Message)
	case session.EventSession:
		v, err = json.Marshal(e.Session)
	default:
		v = e.Payload
	}
	return string(e.Kind), v, err
}

// StoredEvent is an event with its cursor (the stream entry id).
type StoredEvent struct {
	Cursor string
	session.Event
}

func decodeEvent(m redis.XMessage) (StoredEvent, error) {
	kind, _ := m.Values["k"].(string)
	ts, _ := m.Values["t"].(string)
	v, _ := m.Values["v"].(string)
	ms, _ := strconv.ParseInt(ts, 10, 64)
	e := StoredEvent{Cursor: m.ID, Event: session.Event{Kind: session.EventKind(kind), Time: time.UnixMilli(ms)}}
	var err error
	switch e.Kind {
	case session.EventRoute:
		e.Route = new(session.RouteView)
		err = json.Unmarshal([]byte(v), e.Route)
	case session.EventMessage:
		e.Message = new(session.Message)
		err = json.Unmarshal([]byte(v), e.Message)
	case session.EventSession:
		e.Session = new(session.Session)
		err = json.Unmarshal([]byte(v), e.Session)
	case session.EventRuntime, session.EventOutcome, session.EventProgress:
		e.Payload = []byte(v)
	default:
		err = fmt.Errorf("unknown event kind %q", kind)
	}
	return e, err
}

// appendRuntime records runtime events whose ids were not seen before, in
// one script, for a live session only (no record or a deletion intent: the
// events are dropped, as the notify contract says). A new event with an
// audit record (an egress decision) also appends the record to the
// session's audit log (audit.go); a record with a count key (an expected
// denial) is counted there and not logged as an event, one by one.
//
// KEYS: meta, del, seen, events, audit, auditn. ARGV: cap, time, then
// (dedup id, payload, audit JSON or "", count key or "") per event.
var appendRuntime = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local n = 0
for i = 3, #ARGV, 4 do
  if redis.call('SADD', KEYS[3], ARGV[i]) == 1 then
    local ck = ARGV[i+3]
    if ck == '' then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[1], '*', 'k', 'runtime', 't', ARGV[2], 'v', ARGV[i+1])
      n = n + 1
    end
    if ARGV[i+2] ~= '' and (ck == '' or redis.call('HINCRBY', KEYS[6], ck, 1) == 1) then
      redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[1], '*', 'v', ARGV[i+2], 'c', ck)
    end
  end
end
return n
`)

// RuntimeEvent is one runtime event to append: its dedup id and payload,
// and the audit record it makes (nil: none).
type RuntimeEvent struct {
	ID      string
	Payload []byte
	Audit   *session.AuditRecord
}

// AppendRuntime appends new runtime events in order (and their audit
// records) and returns how many events were logged; ErrSessionNotFound
// when the session takes no events.
func (s *Store) AppendRuntime(ctx context.Context, id string, now time.Time, events []RuntimeEvent) (int, error) {
	args := make([]any, 0, 2+4*len(events))
	args = append(args, s.eventCap, now.UnixMilli())
	for _, e := range events {
		var audit []byte
		ck := ""
		if e.Audit != nil {
			var err error
			if audit, err = json.Marshal(e.Audit); err != nil {
				return 0, err
			}
			ck = e.Audit.CountKey()
		}
		args = append(args, "ev:"+e.ID, e.Payload, audit, ck)
	}
	n, err := appendRuntime.Run(ctx, s.rdb,
		[]string{key(id, "meta"), key(id, "del"), key(id, "seen"), key(id, "events"), key(id, "audit"), key(id, "auditn")}, args...).Int()
	if err != nil {
		return 0, err
	}
	if n < 0 {
		return 0, session.ErrSessionNotFound
	}
	return n, nil
}

// LastCursor is the newest event's cursor ("0-0" for an empty log).
func (s *Store) LastCursor(ctx context.Context, id string) (string, error) {
	msgs, err := s.rdb.XRevRangeN(ctx, key(id, "events"), "+", "-", 1).Result()
	if err != nil || len(msgs) == 0 {
		return "0-0", err
	}
	return msgs[0].ID, nil
}

// ConfirmEvents waits, by the client's replication policy, until the
// replicas hold every event of the session's log read so far: a watcher
// sends only events a failover cannot take back (pkg/replication; without
// a policy it is one cheap command).
func (s *Store) ConfirmEvents(ctx context.Context, id string) error {
	return replication.Confirm(ctx, s.rdb, key(id, "events"))
}

// EventsAfter returns up to n events after cursor, oldest first.
func (s *Store) EventsAfter(ctx context.Context, id, cursor string, n int64) ([]StoredEvent, error) {
	msgs, err := s.rdb.XRangeN(ctx, key(id, "events"), "("+cursor, "+", n).Result()
	if err != nil {
		return nil, err
	}
	return decodeAll(msgs)
}

func decodeAll(msgs []redis.XMessage) ([]StoredEvent, error) {
	out := make([]StoredEvent, 0, len(msgs))
	for _, m := range msgs {
		e, err := decodeEvent(m)
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

// CheckCursor refuses a cursor from which resuming would silently skip
// trimmed events: one below the id just before the first retained event of
// a log that was trimmed (more entries were ever added than remain). The
// refusal names that id, the oldest cursor still available. (Redis 7.0 does
// not record trimmed ids in max-deleted-entry-id.)
func (s *Store) CheckCursor(ctx context.Context, id, cursor string) error {
	info, err := s.rdb.XInfoStream(ctx, key(id, "events")).Result()
	if err != nil {
		if strings.HasSuffix(err.Error(), "no such key") {
			return nil // no event yet: nothing was trimmed
		}
		return err
	}
	if info.FirstEntry.ID == "" || info.EntriesAdded <= info.Length {
		return nil
	}
	oldest := cursorJustBefore(info.FirstEntry.ID)
	if !cursorBefore(cursor, oldest) {
		return nil
	}
	return &session.CursorExpiredError{Oldest: oldest}
}

// cursorJustBefore is the greatest stream id below id: resuming after it
// starts at id.
func cursorJustBefore(id string) string {
	ms, seq, _ := cutDash(id)
	m, _ := strconv.ParseUint(ms, 10, 64)
	q, _ := strconv.ParseUint(seq, 10, 64)
	if q > 0 {
		return strconv.FormatUint(m, 10) + "-" + strconv.FormatUint(q-1, 10)
	}
	return strconv.FormatUint(m-1, 10) + "-" + strconv.FormatUint(math.MaxUint64, 10)
}

// cursorBefore reports whether stream id a sorts before b (both valid).
func cursorBefore(a, b string) bool {
	ams, aseq, _ := cutDash(a)
	bms, bseq, _ := cutDash(b)
	am, _ := strconv.ParseUint(ams, 10, 64)
	bm, _ := strconv.ParseUint(bms, 10, 64)
	if am != bm {
		return am < bm
	}
	as, _ := strconv.ParseUint(aseq, 10, 64)
	bs, _ := strconv.ParseUint(bseq, 10, 64)
	return as < bs
}

// ValidCursor reports whether c is a stream entry id ("<ms>-<seq>").
func ValidCursor(c string) bool {
	ms, seq, ok := cutDash(c)
	if !ok {
		return false
	}
	_, err1 := strconv.ParseUint(ms, 10, 64)
	_, err2 := strconv.ParseUint(seq, 10, 64)
	return err1 == nil && err2 == nil
}

func cutDash(c string) (string, string, bool) {
	for i := 0; i < len(c); i++ {
		if c[i] == '-' {
			return c[:i], c[i+1:], i > 0 && i < len(c)-1
		}
	}
	return "", "", false
}
