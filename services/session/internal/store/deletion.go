package store

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/services/session/internal/session"
)

// Intent returns the session's deletion intent, or nil when there is none.
func (s *Store) Intent(ctx context.Context, id string) (*session.DeletionIntent, error) {
	raw, err := s.rdb.Get(ctx, key(id, "del")).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	in := new(session.DeletionIntent)
	return in, json.Unmarshal(raw, in)
}

// DeletionLease takes the session's reconciler lease (pkg/fence resource
// Resource(id), so fence keys share the session's hash tag). It returns
// fence.ErrLeaseHeld while another reconciler drives this deletion.
func (s *Store) DeletionLease(ctx context.Context, id, owner string, ttl time.Duration) (*fence.Lease, error) {
	return fence.Acquire(ctx, s.rdb, Resource(id), owner, ttl)
}

// SaveIntent writes the intent under the reconciler's fencing token and
// schedules its next attempt.
func (s *Store) SaveIntent(ctx context.Context, l *fence.Lease, in *session.DeletionIntent) error {
	raw, err := json.Marshal(in)
	if err != nil {
		return err
	}
	if err := l.Guard(ctx, fence.Set(key(in.SessionID, "del"), raw, 0)); err != nil {
		return err
	}
	return s.rdb.ZAdd(ctx, idxDeleting, redis.Z{Score: float64(in.NextAttempt.UnixMilli()), Member: in.SessionID}).Err()
}

// WipeLocator is what remains of a deleted session: enough for a canonical
// handle minted by it to resolve through a live member of its scope.
type WipeLocator struct {
	SandboxID    string
	Directory    string
	HandleDigest string // empty when no contract reported one to this service
}

// unlinkGuarded unlinks keys (all with the resource's hash tag) if the token
// is still the newest: UNLINK frees large values (a long event log) off the
// main thread, and nothing is read back.
var unlinkGuarded = fence.NewGuardedScript(`
local n = 0
for i = 2, #KEYS do n = n + redis.call('UNLINK', KEYS[i]) end
return n
`)

// WipeBatch is how many keys one UNLINK script removes.
const WipeBatch = 256

// DefaultWipeLocatorTTL is how long a wipe locator stays: the longest grant
// lifetime (4 h) plus the longest retry (1 h, an exhausted wrapper lease's
// recheck window). After it no handle the session minted can be presented.
const DefaultWipeLocatorTTL = 5 * time.Hour

// ForgetFence deletes the session's fencing token and lease: a reconciler
// that took the deletion lease just after another one wiped the session
// wrote them again (the wipe removes them last), and nothing else would.
// Tokens are floored by Redis TIME, so a later grant still exceeds every
// earlier one.
func (s *Store) ForgetFence(ctx context.Context, id string) error {
	return s.rdb.Del(ctx, fence.TokenKey(Resource(id)), fence.LeaseKey(Resource(id))).Err()
}

// Gone reports that the session was wiped: neither record nor intent.
func (s *Store) Gone(ctx context.Context, id string) (bool, error) {
	n, err := s.rdb.Exists(ctx, key(id, "meta"), key(id, "del")).Result()
	return n == 0, err
}

// Wipe removes every key of the session by key only (SCAN with MATCH, then
// batched, fenced UNLINK; no value is loaded), leaves the wipe locator with
// a TTL (ttl ≤ 0: DefaultWipeLocatorTTL), and deletes the record, the intent
// and the session's fencing token last, so the session reads as deleting
// until the end. It then drops the session from every index.
func (s *Store) Wipe(ctx context.Context, l *fence.Lease, in *session.DeletionIntent, loc WipeLocator, ttl time.Duration) error {
	id := in.SessionID
	if ttl <= 0 {
		ttl = DefaultWipeLocatorTTL
	}
	if err := l.Guard(ctx, fence.HSet(WipeLocatorKey(id),
		"sandbox_id", loc.SandboxID, "directory", loc.Directory, "handle_digest", loc.HandleDigest,
		"deleted_at", in.CreateTime.UnixMilli()), fence.PExpire(WipeLocatorKey(id), ttl)); err != nil {
		return err
	}
	node, err := s.nodeFor(ctx, key(id, "meta"))
	if err != nil {
		return err
	}
	last := map[string]bool{key(id, "meta"): true, key(id, "del"): true}
	batch := make([]string, 0, WipeBatch)
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := unlinkGuarded.Run(ctx, s.rdb, Resource(id), l.Token, batch).Err()
		batch = batch[:0]
		return err
	}
	iter := node.Scan(ctx, 0, key(id, "*"), 1000).Iterator()
	for iter.Next(ctx) {
		if k := iter.Val(); !last[k] {
			batch = append(batch, k)
			if len(batch) == WipeBatch {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	if err := iter.Err(); err != nil {
		return err
	}
	if err := flush(); err != nil {
		return err
	}
	// The token goes with the last batch, checked before it is unlinked: a
	// former holder's write then finds no token and fails closed, and a
	// later grant still starts above Redis TIME (pkg/fence).
	if err := unlinkGuarded.Run(ctx, s.rdb, Resource(id), l.Token, []string{key(id, "meta"), key(id, "del"), fence.TokenKey(Resource(id))}).Err(); err != nil {
		return err
	}
	member := indexMember(in.SessionCreate, id)
	_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.ZRem(ctx, orgIndex(in.OrgID), member)
		p.ZRem(ctx, userIndex(in.OrgID, in.UserID), member)
		p.ZRem(ctx, idxActive, id)
		p.ZRem(ctx, idxUpdated, id)
		p.ZRem(ctx, idxDeleting, id)
		return nil
	})
	return err
}

// nodeFor returns the client that can SCAN the node holding k: on Redis
// Cluster, SCAN only sees the node it runs on.
func (s *Store) nodeFor(ctx context.Context, k string) (redis.Cmdable, error) {
	if c, ok := s.rdb.(*redis.ClusterClient); ok {
		return c.MasterForKey(ctx, k)
	}
	return s.rdb, nil
}

// Locator reads a wipe locator (for tests and operators).
func (s *Store) Locator(ctx context.Context, id string) (map[string]string, error) {
	return s.rdb.HGetAll(ctx, WipeLocatorKey(id)).Result()
}
