// Package store keeps the credential service's state in Redis under the
// "cred:" prefix:
//
//	cred:{cr:<ref>}            hash: a backing credential (class, session, secret digest, sealed secret)
//	cred:{cs:<scope-id>}:state JSON scope.State (digests and sealed handles only)
//	cred:{cs:<scope-id>}:version  a version that strictly increases on every scope write
//	cred:{hd:<digest>}         the scope id a handle digest belongs to (lookup index)
//	fence:{cs:<scope-id>}:token   newest sandbox-owner fencing token seen for the scope
//
// A scope's keys go when its state empties (SaveScope of an empty state),
// and a digest's when its entry leaves the state (UnindexDigests).
//
// Every scope write is a pkg/fence guarded script: the token check, a
// compare-and-set on the version, and the write happen in one step.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/services/credential/internal/scope"
)

// Errors of the store.
var (
	ErrNotFound = errors.New("store: not found")
	// ErrConflict means the scope changed since it was read; read and retry.
	ErrConflict = errors.New("store: concurrent scope update")
)

// Retention of bookkeeping keys. The scope state outlives its grants so
// that members stay known; grant expiry itself is enforced by the rules.
const (
	StateTTL   = 7 * 24 * time.Hour
	versionTTL = 30 * 24 * time.Hour
	fenceTTL   = 30 * 24 * time.Hour
)

// Store is the Redis access of the credential service.
type Store struct{ rdb redis.UniversalClient }

// New returns a store on rdb.
func New(rdb redis.UniversalClient) *Store { return &Store{rdb: rdb} }

func credKey(ref string) string      { return "cred:{cr:" + ref + "}" }
func resource(scopeID string) string { return "cs:" + scopeID }
func stateKey(scopeID string) string { return "cred:" + fence.Key(resource(scopeID), "state") }
func versionKey(id string) string    { return "cred:" + fence.Key(resource(id), "version") }
func digestKey(digest string) string { return "cred:{hd:" + digest + "}" }
func fenceTokenKey(id string) string { return fence.TokenKey(resource(id)) }

// Credential is a stored backing credential; the secret stays sealed.
type Credential struct {
	Class        scope.Class
	SessionID    string
	SecretDigest string
	Sealed       []byte
	// A git credential names its repository and Basic user name.
	RepoURL     string
	GitUsername string
	// PushPrefix is the branch prefix the git route admits pushes to ("":
	// the proxy's default).
	PushPrefix string
}

// PutCredential stores a backing credential under ref.
func (s *Store) PutCredential(ctx context.Context, ref string, c Credential) error {
	return s.rdb.HSet(ctx, credKey(ref),
		"class", string(c.Class), "session", c.SessionID, "digest", c.SecretDigest, "sealed", c.Sealed,
		"repo", c.RepoURL, "git_user", c.GitUsername, "push_prefix", c.PushPrefix).Err()
}

// GetCredential reads a backing credential.
func (s *Store) GetCredential(ctx context.Context, ref string) (Credential, error) {
	m, err := s.rdb.HGetAll(ctx, credKey(ref)).Result()
	if err != nil {
		return Credential{}, err
	}
	if len(m) == 0 {
		return Credential{}, ErrNotFound
	}
	return Credential{Class: scope.Class(m["class"]), SessionID: m["session"], SecretDigest: m["digest"], Sealed: []byte(m["sealed"]),
		RepoURL: m["repo"], GitUsername: m["git_user"], PushPrefix: m["push_prefix"]}, nil
}

// DeleteCredential deletes a backing credential; idempotent.
func (s *Store) DeleteCredential(ctx context.Context, ref string) error {
	return s.rdb.Del(ctx, credKey(ref)).Err()
}

// LoadScope reads a scope's state and version in one command. A scope never
// written has no state (nil) and version "".
func (s *Store) LoadScope(ctx context.Context, scopeID string) (*scope.State, string, error) {
	vals, err := s.rdb.MGet(ctx, stateKey(scopeID), versionKey(scopeID)).Result()
	if err != nil {
		return nil, "", err
	}
	version, _ := vals[1].(string)
	raw, ok := vals[0].(string)
	if !ok {
		return nil, version, nil
	}
	var st scope.State
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		return nil, "", fmt.Errorf("store: scope %s state unreadable: %w", scopeID, err)
	}
	return &st, version, nil
}

// observeScript records the newest fencing token seen for a scope and
// refuses an older one. Tokens are canonical decimals, so comparing length
// then text is exact (Lua numbers are not above 2^53). KEYS: token key.
// ARGV: token, ttl ms.
var observeScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
local tok = ARGV[1]
if cur and (#cur > #tok or (#cur == #tok and cur > tok)) then
  return redis.error_reply('FENCE_STALE')
end
redis.call('SET', KEYS[1], tok, 'PX', ARGV[2])
return 1
`)

// ObserveFence makes token the scope's newest token, or fails with
// fence.ErrStaleToken if a newer one was seen. The sandbox service passes
// its owner token; a former owner's older token is refused from then on.
func (s *Store) ObserveFence(ctx context.Context, scopeID string, token uint64) error {
	if token == 0 {
		return fence.ErrStaleToken
	}
	err := observeScript.Run(ctx, s.rdb, []string{fenceTokenKey(scopeID)},
		strconv.FormatUint(token, 10), fenceTTL.Milliseconds()).Err()
	if err != nil && strings.Contains(err.Error(), "FENCE_STALE") {
		return fence.ErrStaleToken
	}
	return err
}

// saveScript runs after pkg/fence's token check: it compares the version
// read by the caller, writes the state and advances the version to
// max(old+1, TIME µs) so it never repeats, even after the key was lost.
// An empty state (the last member left, no handle remains) deletes the
// scope's keys instead, its version and fence token too (issue 32: nothing
// of a deleted session's scope outlives it): both are floored by TIME, so
// the next writer's version and the next owner's token still exceed every
// earlier one, and a cached resolution no longer matches a missing version.
// KEYS[1] fence token, KEYS[2] state, KEYS[3] version. ARGV[2] expected
// version, ARGV[3] state JSON (” deletes), ARGV[4] state ttl ms, ARGV[5]
// version ttl ms.
var saveScript = fence.NewGuardedScript(`
local v = redis.call('GET', KEYS[3]) or ''
if v ~= ARGV[2] then return redis.error_reply('CRED_CAS') end
local t = redis.call('TIME')
local nv = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(v)
if last and last >= nv then nv = last + 1 end
local s = string.format('%.0f', nv)
if ARGV[3] == '' then
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[1])
  return s
end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
redis.call('SET', KEYS[3], s, 'PX', ARGV[5])
return s
`)

// SaveScope writes st (or deletes it when empty) if token is still the
// scope's newest and the version is still expectVersion. It returns the new
// version; fence.ErrStaleToken or ErrConflict write nothing.
func (s *Store) SaveScope(ctx context.Context, scopeID string, token uint64, expectVersion string, st *scope.State) (string, error) {
	body := ""
	if !st.Empty() {
		b, err := json.Marshal(st)
		if err != nil {
			return "", err
		}
		body = string(b)
	}
	v, err := saveScript.Run(ctx, s.rdb, resource(scopeID), token,
		[]string{stateKey(scopeID), versionKey(scopeID)},
		expectVersion, body, StateTTL.Milliseconds(), versionTTL.Milliseconds()).Text()
	switch {
	case err == nil:
		return v, nil
	case strings.Contains(err.Error(), "CRED_CAS"):
		return "", ErrConflict
	default:
		return "", err
	}
}

// IndexDigest points a handle digest at its scope until ttl passes.
func (s *Store) IndexDigest(ctx context.Context, digest, scopeID string, ttl time.Duration) error {
	return s.rdb.Set(ctx, digestKey(digest), scopeID, ttl).Err()
}

// UnindexDigests drops handle digests from the index: their entries left
// the scope, so they resolve to nothing any more. Each digest is its own
// hash slot, so one DEL per digest (pipelined).
func (s *Store) UnindexDigests(ctx context.Context, digests []string) error {
	if len(digests) == 0 {
		return nil
	}
	pipe := s.rdb.Pipeline()
	for _, d := range digests {
		pipe.Del(ctx, digestKey(d))
	}
	_, err := pipe.Exec(ctx)
	return err
}

// ScopeOfDigest returns the scope id a handle digest belongs to.
func (s *Store) ScopeOfDigest(ctx context.Context, digest string) (string, error) {
	id, err := s.rdb.Get(ctx, digestKey(digest)).Result()
	if errors.Is(err, redis.Nil) {
		return "", ErrNotFound
	}
	return id, err
}

// Freshness reads, in one round trip, a scope's version and whether a
// backing credential still exists: what a cached resolution must match to
// be renewed.
func (s *Store) Freshness(ctx context.Context, scopeID, credRef string) (version string, credential bool, err error) {
	pipe := s.rdb.Pipeline()
	v := pipe.Get(ctx, versionKey(scopeID))
	e := pipe.Exists(ctx, credKey(credRef))
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return "", false, err
	}
	return v.Val(), e.Val() == 1, nil
}
