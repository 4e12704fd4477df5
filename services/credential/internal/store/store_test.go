package store_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/credential/internal/scope"
	"agentplane.dev/services/credential/internal/store"
)

var ctx = context.Background()

func newStore(t *testing.T) (*store.Store, redis.UniversalClient) {
	rdb := redistest.Universal(t)
	return store.New(rdb), rdb
}

func state(session string) *scope.State {
	return &scope.State{
		Scope:   scope.Scope{SandboxID: "sb", Directory: "/repo"},
		Members: []scope.Member{{SessionID: session, RuntimeSessionID: "rs-" + session, UserID: "u"}},
	}
}

// The newest sandbox-owner token wins: equal and newer tokens pass, an
// older or zero one is refused. Tokens of different lengths compare as
// numbers, not text ("9" < "10").
func TestObserveFenceRefusesOlderTokens(t *testing.T) {
	s, _ := newStore(t)
	require.NoError(t, s.ObserveFence(ctx, "sc1", 9))
	require.NoError(t, s.ObserveFence(ctx, "sc1", 9), "the same owner again")
	require.NoError(t, s.ObserveFence(ctx, "sc1", 10))
	require.ErrorIs(t, s.ObserveFence(ctx, "sc1", 9), fence.ErrStaleToken)
	require.ErrorIs(t, s.ObserveFence(ctx, "sc1", 0), fence.ErrStaleToken)
	require.NoError(t, s.ObserveFence(ctx, "sc2", 1), "scopes are independent")
}

// A scope write needs the newest token and the version it read; a failed
// write changes nothing, and versions strictly increase, even after the
// version key was lost.
func TestSaveScopeFencedCompareAndSet(t *testing.T) {
	s, rdb := newStore(t)
	require.NoError(t, s.ObserveFence(ctx, "sc", 5))

	st, v0, err := s.LoadScope(ctx, "sc")
	require.NoError(t, err)
	require.Nil(t, st, "never written")
	require.Empty(t, v0)

	v1, err := s.SaveScope(ctx, "sc", 5, v0, state("a"))
	require.NoError(t, err)
	require.NotEmpty(t, v1)

	_, err = s.SaveScope(ctx, "sc", 5, v0, state("b"))
	require.ErrorIs(t, err, store.ErrConflict, "the version moved on")
	_, err = s.SaveScope(ctx, "sc", 4, v1, state("b"))
	require.ErrorIs(t, err, fence.ErrStaleToken)
	got, v, err := s.LoadScope(ctx, "sc")
	require.NoError(t, err)
	require.Equal(t, v1, v, "refused writes left the version")
	require.Equal(t, "a", got.Members[0].SessionID, "refused writes left the state")

	// The version key is lost (eviction, a restart without it): the next
	// version is still above every earlier one.
	require.NoError(t, rdb.Del(ctx, "cred:{cs:sc}:version").Err())
	v2, err := s.SaveScope(ctx, "sc", 5, "", state("c"))
	require.NoError(t, err)
	require.Greater(t, mustUint(t, v2), mustUint(t, v1))

	// An empty state deletes the scope's keys (issue 32): state, version and
	// fence token. A guarded write then needs its token observed again, and
	// the next version is still above every earlier one.
	v3, err := s.SaveScope(ctx, "sc", 5, v2, &scope.State{Scope: scope.Scope{SandboxID: "sb", Directory: "/repo"}})
	require.NoError(t, err)
	require.Greater(t, mustUint(t, v3), mustUint(t, v2))
	st, v, err = s.LoadScope(ctx, "sc")
	require.NoError(t, err)
	require.Nil(t, st)
	require.Empty(t, v)
	require.Zero(t, rdb.Exists(ctx, "cred:{cs:sc}:state", "cred:{cs:sc}:version", "fence:{cs:sc}:token").Val(), "no key of the scope is left")
	_, err = s.SaveScope(ctx, "sc", 5, "", state("d"))
	require.ErrorIs(t, err, fence.ErrStaleToken, "a token Redis no longer holds writes nothing")
	require.NoError(t, s.ObserveFence(ctx, "sc", 6))
	v4, err := s.SaveScope(ctx, "sc", 6, "", state("d"))
	require.NoError(t, err)
	require.Greater(t, mustUint(t, v4), mustUint(t, v3))
}

func mustUint(t *testing.T, s string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(s, 10, 64)
	require.NoError(t, err, "version %q", s)
	return n
}

// A state that does not parse is an error, never a scope without state:
// treating it as absent would let a new handle replace live ones.
func TestLoadScopeUnreadableIsAnError(t *testing.T) {
	s, rdb := newStore(t)
	require.NoError(t, rdb.Set(ctx, "cred:{cs:sc}:state", "{not json", 0).Err())
	st, _, err := s.LoadScope(ctx, "sc")
	require.Error(t, err)
	require.Nil(t, st)
}

func TestCredentialsAndDigestIndex(t *testing.T) {
	s, rdb := newStore(t)
	_, err := s.GetCredential(ctx, "ref1")
	require.ErrorIs(t, err, store.ErrNotFound)

	c := store.Credential{Class: scope.Static, SessionID: "s1", SecretDigest: "d1", Sealed: []byte{0, 1, 0xff}}
	require.NoError(t, s.PutCredential(ctx, "ref1", c))
	got, err := s.GetCredential(ctx, "ref1")
	require.NoError(t, err)
	require.Equal(t, c, got)

	// Freshness: the scope's version and whether the credential exists, in
	// one round trip.
	v, err := s.SaveScope(ctx, "sc", 1, "", state("s1"))
	require.ErrorIs(t, err, fence.ErrStaleToken, "no token observed yet")
	require.Empty(t, v)
	require.NoError(t, s.ObserveFence(ctx, "sc", 1))
	v, err = s.SaveScope(ctx, "sc", 1, "", state("s1"))
	require.NoError(t, err)
	fv, exists, err := s.Freshness(ctx, "sc", "ref1")
	require.NoError(t, err)
	require.Equal(t, v, fv)
	require.True(t, exists)

	require.NoError(t, s.DeleteCredential(ctx, "ref1"))
	require.NoError(t, s.DeleteCredential(ctx, "ref1"), "idempotent")
	_, exists, err = s.Freshness(ctx, "sc", "ref1")
	require.NoError(t, err)
	require.False(t, exists)
	fv, _, err = s.Freshness(ctx, "never", "ref1")
	require.NoError(t, err)
	require.Empty(t, fv, "a scope never written has no version")

	_, err = s.ScopeOfDigest(ctx, "dg")
	require.ErrorIs(t, err, store.ErrNotFound)
	require.NoError(t, s.IndexDigest(ctx, "dg", "sc", time.Minute))
	id, err := s.ScopeOfDigest(ctx, "dg")
	require.NoError(t, err)
	require.Equal(t, "sc", id)
	ttl, err := rdb.PTTL(ctx, "cred:{hd:dg}").Result()
	require.NoError(t, err)
	require.Positive(t, ttl, "the index entry expires with its handle")
	require.NoError(t, s.IndexDigest(ctx, "dg2", "sc", time.Minute))
	require.NoError(t, s.UnindexDigests(ctx, []string{"dg", "dg2", "never"}))
	require.Zero(t, rdb.Exists(ctx, "cred:{hd:dg}", "cred:{hd:dg2}").Val(), "unindexed digests are gone")
	require.NoError(t, s.UnindexDigests(ctx, nil))
}

// Inspection failure is never absence: with Redis gone, reads fail rather
// than report "not found" or "no state".
func TestRedisDownIsNotAbsence(t *testing.T) {
	srv := redistest.Start(t)
	opt := srv.Options()
	opt.MaxRetries = -1 // fail at once: retries only slow the test
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })
	s := store.New(rdb)
	require.NoError(t, srv.Stop())
	_, err := s.GetCredential(ctx, "ref1")
	require.Error(t, err)
	require.NotErrorIs(t, err, store.ErrNotFound)
	_, err = s.ScopeOfDigest(ctx, "dg")
	require.Error(t, err)
	require.NotErrorIs(t, err, store.ErrNotFound)
	_, _, err = s.LoadScope(ctx, "sc")
	require.Error(t, err)
	_, _, err = s.Freshness(ctx, "sc", "ref1")
	require.Error(t, err)
}
