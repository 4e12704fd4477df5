package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/services/session/internal/session"
)

// The audit log of a session (DESIGN.md 5 "Usage and audit"), kept with
// its other keys and wiped with them:
//
//	ses:{ses/id}:audit    stream: one entry per record (v: JSON, c: count key or ""), MAXLEN ~ EventCap
//	ses:{ses/id}:auditn   hash count key → how many expected denials the record stands for

// appendAudit stores records for a live session only (no record or a
// deletion intent: dropped, as the notify contract says). A record with a
// count key is stored the first time its key is counted; later ones only
// count. KEYS: meta, del, audit, auditn. ARGV: cap, then (count key, JSON)
// pairs. Returns how many entries were added, -1 for no live session.
var appendAudit = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local n = 0
for i = 2, #ARGV, 2 do
  local ck = ARGV[i]
  if ck == '' or redis.call('HINCRBY', KEYS[4], ck, 1) == 1 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[1], '*', 'v', ARGV[i+1], 'c', ck)
    n = n + 1
  end
end
return n
`)

// AppendAudit stores the session's audit records in order and returns how
// many new entries it made; session.ErrSessionNotFound when the session
// takes none.
func (s *Store) AppendAudit(ctx context.Context, id string, recs []session.AuditRecord) (int, error) {
	if len(recs) == 0 {
		return 0, nil
	}
	args := make([]any, 0, 1+2*len(recs))
	args = append(args, s.eventCap)
	for i := range recs {
		raw, err := json.Marshal(&recs[i])
		if err != nil {
			return 0, err
		}
		args = append(args, recs[i].CountKey(), raw)
	}
	n, err := appendAudit.Run(ctx, s.rdb,
		[]string{key(id, "meta"), key(id, "del"), key(id, "audit"), key(id, "auditn")}, args...).Int()
	if err != nil {
		return 0, err
	}
	if n < 0 {
		return 0, session.ErrSessionNotFound
	}
	return n, nil
}

// auditScanLimit bounds the entries one ListAudit reads while it filters
// by turn: a page may then hold fewer records than asked, with a token.
const auditScanLimit = 10_000

var auditCursor = regexp.MustCompile(`^[0-9]{1,20}-[0-9]{1,20}$`)

// ValidAuditCursor reports whether c can be a ListAudit cursor (a stream
// entry id).
func ValidAuditCursor(c string) bool { return auditCursor.MatchString(c) }

// ListAudit returns up to n of the session's audit records after the
// cursor (a record id; "" from the start), oldest first, only turn's when
// turn is set, and the cursor of the next page ("" after the last).
func (s *Store) ListAudit(ctx context.Context, id, after, turn string, n int) ([]session.AuditRecord, string, error) {
	start := "-"
	if after != "" {
		start = "(" + after
	}
	var out []session.AuditRecord
	var counted []int // indexes in out of records with a count key
	var keys []string
	scanned := 0
	for {
		batch := int64(n + 1 - len(out))
		if turn != "" {
			batch = max(batch, 256)
		}
		msgs, err := s.rdb.XRangeN(ctx, key(id, "audit"), start, "+", batch).Result()
		if err != nil {
			return nil, "", err
		}
		for _, m := range msgs {
			if len(out) == n {
				// One more exists: the page ends at the previous entry.
				if err := s.auditCounts(ctx, id, out, counted, keys); err != nil {
					return nil, "", err
				}
				return out, out[n-1].ID, nil
			}
			scanned++
			start = "(" + m.ID
			r, ck, err := decodeAudit(m)
			if err != nil {
				return nil, "", fmt.Errorf("session %s: audit record %s: %w", id, m.ID, err)
			}
			if turn != "" && r.TurnID != turn {
				continue
			}
			if ck != "" {
				counted, keys = append(counted, len(out)), append(keys, ck)
			}
			out = append(out, r)
		}
		if len(msgs) < int(batch) {
			return out, "", s.auditCounts(ctx, id, out, counted, keys)
		}
		if scanned >= auditScanLimit {
			// Bounded work per page: the caller goes on from here.
			return out, start[1:], s.auditCounts(ctx, id, out, counted, keys)
		}
	}
}

func decodeAudit(m redis.XMessage) (session.AuditRecord, string, error) {
	v, _ := m.Values["v"].(string)
	ck, _ := m.Values["c"].(string)
	var r session.AuditRecord
	if err := json.Unmarshal([]byte(v), &r); err != nil {
		return r, "", err
	}
	r.ID = m.ID
	if r.Egress != nil {
		r.Egress.Count = 1
	}
	return r, ck, nil
}

// auditCounts sets the counts of the counted records of out.
func (s *Store) auditCounts(ctx context.Context, id string, out []session.AuditRecord, counted []int, keys []string) error {
	if len(keys) == 0 {
		return nil
	}
	vals, err := s.rdb.HMGet(ctx, key(id, "auditn"), keys...).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	for i, v := range vals {
		str, _ := v.(string)
		var c uint64
		if _, err := fmt.Sscan(str, &c); err == nil && c > 0 && out[counted[i]].Egress != nil {
			out[counted[i]].Egress.Count = c
		}
	}
	return nil
}
