// Package leasestore keeps wrapper leases in Redis. All leases of a sandbox
// live in one hash, sbx:{<fence resource>}:wrapper-leases, field = runtime
// key, value = lease.Encode JSON. The hash carries the sandbox fence's hash
// tag, and every write is one pkg/fence guarded script that checks the
// sandbox's fencing token and compares the previous value (so a writer that
// read an older version, even under the same token, changes nothing).
//
// It is the reconciler's store; internal/control/store holds the rest of a
// sandbox's state (routes, scopes, wrapper records, slots), written by the
// driver. The two stay apart because a lease write compares its previous
// value and a lease outlives the driver's view of its sandbox.
package leasestore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/services/sandbox/internal/control/lease"
)

// ErrConflict: the stored lease changed since it was read; re-read and
// re-apply the event.
var ErrConflict = errors.New("leasestore: lease changed concurrently")

// Key is the hash of every lease of the sandbox whose fence resource is
// resource.
func Key(resource string) string { return "sbx:" + fence.Key(resource, "wrapper-leases") }

// Entry is a stored lease with the raw value it was read from.
type Entry struct {
	Lease lease.Lease
	// Quarantined is set when the stored value failed to parse; Lease is
	// then lease.Quarantine.
	Quarantined error
	raw         string
}

// Store reads and writes leases.
type Store struct {
	rdb redis.UniversalClient
	now func() time.Time
}

// New builds a Store; now stamps quarantined leases.
func New(rdb redis.UniversalClient, now func() time.Time) *Store {
	return &Store{rdb: rdb, now: now}
}

// Get reads one lease; a missing one is none with generation 0.
func (s *Store) Get(ctx context.Context, resource, runtimeKey string) (Entry, error) {
	raw, err := s.rdb.HGet(ctx, Key(resource), runtimeKey).Result()
	if errors.Is(err, redis.Nil) {
		return Entry{Lease: lease.Lease{State: lease.None}}, nil
	}
	if err != nil {
		return Entry{}, fmt.Errorf("leasestore: get: %w", err)
	}
	return s.decode(raw), nil
}

// All reads every lease of the sandbox, by runtime key.
func (s *Store) All(ctx context.Context, resource string) (map[string]Entry, error) {
	m, err := s.rdb.HGetAll(ctx, Key(resource)).Result()
	if err != nil {
		return nil, fmt.Errorf("leasestore: all: %w", err)
	}
	out := make(map[string]Entry, len(m))
	for k, raw := range m {
		out[k] = s.decode(raw)
	}
	return out, nil
}

func (s *Store) decode(raw string) Entry {
	l, err := lease.Decode([]byte(raw), s.now())
	return Entry{Lease: l, Quarantined: err, raw: raw}
}

// casScript replaces the field only if it still holds the value read.
var casScript = fence.NewGuardedScript(`
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if cur == false then cur = '' end
if cur ~= ARGV[3] then return redis.error_reply('LEASE_CONFLICT') end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
return 1
`)

// Put writes next in place of prev under the sandbox's fencing token.
// fence.ErrStaleToken: a newer token exists (this replica lost the
// sandbox). ErrConflict: the lease changed since prev was read.
func (s *Store) Put(ctx context.Context, resource string, token uint64, runtimeKey string, prev Entry, next lease.Lease) (Entry, error) {
	b, err := lease.Encode(next)
	if err != nil {
		return Entry{}, fmt.Errorf("leasestore: encode: %w", err)
	}
	err = casScript.Run(ctx, s.rdb, resource, token, []string{Key(resource)}, runtimeKey, prev.raw, string(b)).Err()
	if err != nil {
		if strings.Contains(err.Error(), "LEASE_CONFLICT") {
			return Entry{}, ErrConflict
		}
		return Entry{}, fmt.Errorf("leasestore: put: %w", err)
	}
	return Entry{Lease: next, raw: string(b)}, nil
}

// dropScript removes the field only if it still holds the value read.
var dropScript = fence.NewGuardedScript(`
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if cur == false then return 0 end
if cur ~= ARGV[3] then return redis.error_reply('LEASE_CONFLICT') end
return redis.call('HDEL', KEYS[2], ARGV[2])
`)

// Drop removes the lease of a runtime key that is gone with its last
// session (prev as read, under the sandbox's fencing token). A key
// allocated again starts a new lease.
func (s *Store) Drop(ctx context.Context, resource string, token uint64, runtimeKey string, prev Entry) error {
	err := dropScript.Run(ctx, s.rdb, resource, token, []string{Key(resource)}, runtimeKey, prev.raw).Err()
	if err != nil {
		if strings.Contains(err.Error(), "LEASE_CONFLICT") {
			return ErrConflict
		}
		return fmt.Errorf("leasestore: drop: %w", err)
	}
	return nil
}
