package grants

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testclock"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
	"agentplane.dev/services/credential/internal/sealer"
)

// counter counts every command sent to Redis.
type counter struct{ n atomic.Int64 }

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { c.n.Add(1); return next(ctx, cmd) }
}
func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { c.n.Add(int64(len(cmds))); return next(ctx, cmds) }
}

var policy = scope.Policy{GrantTTL: 4 * time.Hour, ReissueBelow: time.Hour, OverlapWindow: 5 * time.Minute}

// trustWindow is the tests' resolution cache window. Time is the test
// clock: a revoking write's wait advances it instead of sleeping.
const trustWindow = time.Second

type env struct {
	svc   *Service
	rdb   *redis.Client
	clock *testclock.Clock
	cmds  *counter
	key   []byte
	waits atomic.Int64 // calls of the revocation wait
}

func newEnv(t *testing.T) *env {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	c := &counter{}
	rdb.AddHook(c)
	e := &env{rdb: rdb, clock: testclock.New(time.Now()), cmds: c, key: sealer.RandomKey()}
	e.svc = e.replica(t, policy)
	return e
}

// replica is another credential service process on the same Redis and
// clock, with its own resolution cache.
func (e *env) replica(t *testing.T, p scope.Policy) *Service {
	svc, err := New(e.rdb, e.key, Options{Policy: p, Now: e.clock.Now, TrustWindow: trustWindow, Wait: e.wait})
	require.NoError(t, err)
	return svc
}

func (e *env) wait(_ context.Context, d time.Duration) error {
	e.waits.Add(1)
	e.clock.Add(d)
	return nil
}

var ctx = context.Background()

func (e *env) put(t *testing.T, session string, class scope.Class, secret string) string {
	ref, digest, err := e.svc.PutCredential(ctx, session, class, []byte(secret))
	require.NoError(t, err)
	require.Equal(t, SecretDigest([]byte(secret)), digest)
	return ref
}

func (e *env) join(t *testing.T, n int, fence uint64, secret string) scope.Join {
	s := fmt.Sprintf("ses-%d", n)
	return scope.Join{
		Member: scope.Member{SessionID: s, RuntimeSessionID: "rs-" + s, UserID: "user", CredentialRef: e.put(t, s, scope.Static, secret)},
		Class:  scope.Static, Contract: scope.Worktree, Fence: fence, AllocationID: "alloc-1",
	}
}

var sc = scope.Scope{SandboxID: "sbx-1", Directory: "/work/repo"}

func TestFullLifecycleStoresOnlyDigests(t *testing.T) {
	e := newEnv(t)
	secrets := []string{"sk-live-SECRET-one-0123456789", "sk-live-SECRET-two-0123456789"}
	var handles []string

	h1, g, adopted, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, secrets[0]))
	require.NoError(t, err)
	require.False(t, adopted)
	require.Equal(t, handle.DigestOf(h1).String(), g.Digest)
	handles = append(handles, h1)
	h2, _, err := e.svc.Adopt(ctx, sc, e.join(t, 2, 100, secrets[1]))
	require.NoError(t, err)
	require.Equal(t, h1, h2)

	ps := e.join(t, 3, 100, secrets[0])
	ps.Contract = scope.PerSession
	_, _, _, err = e.svc.Mint(ctx, scope.Scope{SandboxID: "sbx-1", Directory: "/work/other"}, ps)
	require.NoError(t, err)

	r, err := e.svc.Resolve(ctx, h1, "sbx-1")
	require.NoError(t, err)
	require.Equal(t, secrets[0], string(r.Secret))
	h3, _, _, err := e.svc.Rotate(ctx, sc, 100)
	require.NoError(t, err)
	handles = append(handles, h3)
	_, _, err = e.svc.Release(ctx, sc, "ses-1", 100)
	require.NoError(t, err)
	r, err = e.svc.Resolve(ctx, h3, "sbx-1")
	require.NoError(t, err)
	require.Equal(t, secrets[1], string(r.Secret), "resolves through the remaining member's credential")

	// Scan every key and value for the raw forms.
	var forbidden []string
	for _, s := range append(append([]string{}, secrets...), handles...) {
		b := []byte(s)
		forbidden = append(forbidden, s, base64.StdEncoding.EncodeToString(b), base64.RawURLEncoding.EncodeToString(b),
			base64.RawStdEncoding.EncodeToString(b), hex.EncodeToString(b))
	}
	for _, h := range handles {
		forbidden = append(forbidden, h[4:47]) // the random body alone
	}
	keys, err := e.rdb.Keys(ctx, "*").Result()
	require.NoError(t, err)
	require.NotEmpty(t, keys)
	for _, k := range keys {
		var vals []string
		switch typ := e.rdb.Type(ctx, k).Val(); typ {
		case "string":
			vals = []string{e.rdb.Get(ctx, k).Val()}
		case "hash":
			for f, v := range e.rdb.HGetAll(ctx, k).Val() {
				vals = append(vals, f, v)
			}
		default:
			t.Fatalf("unexpected key type %s", typ)
		}
		for _, v := range append(vals, k) {
			for _, f := range forbidden {
				if strings.Contains(v, f) || strings.Contains(strings.ToLower(v), strings.ToLower(f)) {
					t.Fatalf("key %s holds a raw secret or handle form", k)
				}
			}
		}
	}
}

func TestBadChecksumNeverReachesRedis(t *testing.T) {
	e := newEnv(t)
	h, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, "sk-x"))
	require.NoError(t, err)
	bad := []byte(h)
	bad[10] ^= 1
	before := e.cmds.n.Load()
	for _, raw := range []string{string(bad), h[:len(h)-1] + "A", "", "aph_short", strings.ToUpper(h)} {
		if raw == h {
			continue
		}
		_, err := e.svc.Resolve(ctx, raw, "sbx-1")
		require.ErrorIs(t, err, ErrMalformedHandle)
	}
	require.Equal(t, before, e.cmds.n.Load(), "no Redis command for a malformed handle")
	_, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	require.Greater(t, e.cmds.n.Load(), before)
}

func TestRotationOverlapAndConflict(t *testing.T) {
	e := newEnv(t)
	old, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, "sk-1"))
	require.NoError(t, err)
	same, _, err := e.svc.Adopt(ctx, sc, e.join(t, 2, 100, "sk-2"))
	require.NoError(t, err)
	require.Equal(t, old, same)

	rotatedAt := e.clock.Now()
	nh, g, until, err := e.svc.Rotate(ctx, sc, 100)
	require.NoError(t, err)
	require.Len(t, g.Members, 2, "every member gets the new handle at once")
	require.Equal(t, rotatedAt.Add(policy.OverlapWindow), until)
	again, _, err := e.svc.Adopt(ctx, sc, e.join(t, 2, 100, "sk-2"))
	require.NoError(t, err)
	require.Equal(t, nh, again)
	_, err = e.svc.Resolve(ctx, old, "sbx-1")
	require.NoError(t, err, "old handle works in the overlap")
	e.clock.Add(policy.OverlapWindow)
	_, err = e.svc.Resolve(ctx, old, "sbx-1")
	require.ErrorIs(t, err, scope.ErrUnknownHandle, "old handle stops after the overlap")
	_, err = e.svc.Resolve(ctx, nh, "sbx-1")
	require.NoError(t, err)

	before, err := e.svc.State(ctx, sc)
	require.NoError(t, err)
	_, _, err = e.svc.Adopt(ctx, sc, e.join(t, 3, 200, "sk-3"))
	require.ErrorIs(t, err, scope.ErrHandleConflict)
	after, err := e.svc.State(ctx, sc)
	require.NoError(t, err)
	require.Equal(t, before, after, "the surviving grant is unchanged")
	_, err = e.svc.Resolve(ctx, nh, "sbx-1")
	require.NoError(t, err)

	// The old owner's token is now refused: a newer one was seen.
	_, _, _, err = e.svc.Rotate(ctx, sc, 100)
	require.ErrorIs(t, err, ErrStaleFence)
}

func TestClassMixed(t *testing.T) {
	e := newEnv(t)
	_, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, "sk-1"))
	require.NoError(t, err)
	j := e.join(t, 2, 100, "x")
	j.Member.CredentialRef = e.put(t, "ses-2", scope.Delegated, "tok")
	j.Class = scope.Delegated
	_, _, err = e.svc.Adopt(ctx, sc, j)
	require.ErrorIs(t, err, scope.ErrClassMixed)
	_, _, _, err = e.svc.Mint(ctx, sc, j)
	require.ErrorIs(t, err, scope.ErrClassMixed)
	j.Class = scope.Static // claims static, but the stored credential is delegated
	_, _, err = e.svc.Adopt(ctx, sc, j)
	require.ErrorIs(t, err, ErrClassMismatch)
}

func TestConcurrentRotationsKeepAtMostFourLive(t *testing.T) {
	e := newEnv(t)
	_, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, "sk-1"))
	require.NoError(t, err)
	stop := make(chan struct{})
	var maxSeen atomic.Int64
	var watch sync.WaitGroup
	watch.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			st, err := e.svc.State(ctx, sc)
			if err == nil && st != nil {
				if n := int64(st.LiveWorktreeEntries(e.clock.Now())); n > maxSeen.Load() {
					maxSeen.Store(n)
				}
			}
		}
	})
	var wg sync.WaitGroup
	var rotated atomic.Int64
	for range 8 {
		wg.Go(func() {
			for range 25 {
				if _, _, _, err := e.svc.Rotate(ctx, sc, 100); err == nil {
					rotated.Add(1)
				} else {
					require.ErrorIs(t, err, ErrBusy)
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	watch.Wait()
	require.Greater(t, rotated.Load(), int64(50))
	st, err := e.svc.State(ctx, sc)
	require.NoError(t, err)
	require.Equal(t, scope.MaxAccepted, st.LiveWorktreeEntries(e.clock.Now()))
	require.LessOrEqual(t, maxSeen.Load(), int64(scope.MaxAccepted))
	require.Positive(t, maxSeen.Load())
}

func TestRetireAll(t *testing.T) {
	for _, c := range []struct {
		name string
		run  func(e *env) error
	}{
		{"wrapper restart", func(e *env) error { _, err := e.svc.Retire(ctx, sc, false, 100); return err }},
		{"allocation change", func(e *env) error {
			j := e.join(t, 1, 100, "sk-1")
			j.AllocationID = "alloc-2"
			_, _, _, err := e.svc.Mint(ctx, sc, j)
			return err
		}},
		{"explicit allocation change", func(e *env) error { _, err := e.svc.Retire(ctx, sc, false, 101); return err }},
		{"last member leaves", func(e *env) error {
			for _, s := range []string{"ses-1", "ses-2"} {
				if _, _, err := e.svc.Release(ctx, sc, s, 100); err != nil {
					return err
				}
			}
			return nil
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			h, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, "sk-1"))
			require.NoError(t, err)
			_, _, err = e.svc.Adopt(ctx, sc, e.join(t, 2, 100, "sk-2"))
			require.NoError(t, err)
			var old []string
			old = append(old, h)
			for range 3 {
				nh, _, _, err := e.svc.Rotate(ctx, sc, 100)
				require.NoError(t, err)
				old = append(old, nh)
			}
			require.NoError(t, c.run(e))
			for _, h := range old {
				_, err := e.svc.Resolve(ctx, h, "sbx-1")
				require.ErrorIs(t, err, scope.ErrUnknownHandle)
			}
			st, err := e.svc.State(ctx, sc)
			require.NoError(t, err)
			if st != nil {
				for _, en := range st.Entries {
					require.NotContains(t, []string{handle.DigestOf(old[0]).String()}, en.Digest)
					require.Zero(t, st.LiveWorktreeEntries(e.clock.Now())-1, "only a freshly minted handle may remain")
				}
			}
		})
	}
}

func TestIssuerDeletedResolvesThroughLiveMember(t *testing.T) {
	e := newEnv(t)
	j1 := e.join(t, 1, 100, "sk-issuer")
	h, _, _, err := e.svc.Mint(ctx, sc, j1)
	require.NoError(t, err)
	_, _, err = e.svc.Adopt(ctx, sc, e.join(t, 2, 100, "sk-sibling"))
	require.NoError(t, err)
	r, err := e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	require.Equal(t, "ses-1", r.Member.SessionID)

	// The issuer's session is deleted: released and its secret deleted.
	retired, left, err := e.svc.Release(ctx, sc, "ses-1", 100)
	require.NoError(t, err)
	require.False(t, retired)
	require.Equal(t, 1, left)
	require.NoError(t, e.svc.DeleteCredential(ctx, j1.Member.CredentialRef))
	r, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	require.Equal(t, "ses-2", r.Member.SessionID)
	require.Equal(t, "sk-sibling", string(r.Secret))
	require.Equal(t, "ses-1", r.Grant.Issuer)

	retired, _, err = e.svc.Release(ctx, sc, "ses-2", 100)
	require.NoError(t, err)
	require.True(t, retired)
	_, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.ErrorIs(t, err, scope.ErrUnknownHandle)
}

func TestSandboxMismatchAndCachedRevocation(t *testing.T) {
	e := newEnv(t)
	j := e.join(t, 1, 100, "sk-1")
	h, _, _, err := e.svc.Mint(ctx, sc, j)
	require.NoError(t, err)
	_, err = e.svc.Resolve(ctx, h, "sbx-2")
	require.ErrorIs(t, err, scope.ErrSandboxMismatch)
	_, err = e.svc.Resolve(ctx, h, "sbx-1") // now cached
	require.NoError(t, err)
	_, err = e.svc.Resolve(ctx, h, "sbx-2")
	require.ErrorIs(t, err, scope.ErrSandboxMismatch, "the cache checks the sandbox too")

	// Another replica (a second service on the same Redis, with its own
	// cache) revokes: this one's cache must not serve the handle any more.
	other := e.replica(t, policy)
	_, _, err = other.Release(ctx, sc, "ses-1", 100)
	require.NoError(t, err)
	_, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.ErrorIs(t, err, scope.ErrUnknownHandle)

	// A deleted backing credential stops a cached resolution too.
	j2 := e.join(t, 2, 100, "sk-2")
	sc2 := scope.Scope{SandboxID: "sbx-1", Directory: "/other"}
	h2, _, _, err := e.svc.Mint(ctx, sc2, j2)
	require.NoError(t, err)
	_, err = e.svc.Resolve(ctx, h2, "sbx-1")
	require.NoError(t, err)
	require.NoError(t, other.DeleteCredential(ctx, j2.Member.CredentialRef))
	_, err = e.svc.Resolve(ctx, h2, "sbx-1")
	require.ErrorIs(t, err, scope.ErrNoLiveMember)
}

func TestStaleFenceRefusedAndNothingWritten(t *testing.T) {
	e := newEnv(t)
	_, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 200, "sk-1"))
	require.NoError(t, err)
	before, _ := e.svc.State(ctx, sc)
	_, _, _, err = e.svc.Mint(ctx, sc, e.join(t, 2, 199, "sk-2"))
	require.ErrorIs(t, err, ErrStaleFence)
	_, err = e.svc.Retire(ctx, sc, true, 150)
	require.ErrorIs(t, err, ErrStaleFence)
	_, _, err = e.svc.Release(ctx, sc, "ses-1", 0)
	require.ErrorIs(t, err, ErrStaleFence)
	after, _ := e.svc.State(ctx, sc)
	require.Equal(t, before, after)
}

func TestMintIdempotentSameFence(t *testing.T) {
	e := newEnv(t)
	j := e.join(t, 1, 100, "sk-1")
	h1, _, a1, err := e.svc.Mint(ctx, sc, j)
	require.NoError(t, err)
	h2, _, a2, err := e.svc.Mint(ctx, sc, j)
	require.NoError(t, err)
	require.Equal(t, h1, h2)
	require.False(t, a1)
	require.True(t, a2)
	_, _, _, err = e.svc.Mint(ctx, sc, scope.Join{Member: scope.Member{SessionID: "x", CredentialRef: "cr_missing"}, Class: scope.Static, Fence: 100})
	require.ErrorIs(t, err, ErrCredentialNotFound)
}

// TestRevokingWritesOutlastOtherCaches: for every write that takes
// something away, a replica that cached the resolution just before does not
// serve it to a request that starts after the write returned. The replica's
// cache window runs on the test clock, which only the revocation wait
// advances: a path that did not wait would be served from the cache.
func TestRevokingWritesOutlastOtherCaches(t *testing.T) {
	short := policy
	short.OverlapWindow = trustWindow / 2 // ends before the wait does
	for _, c := range []struct {
		name   string
		revoke func(t *testing.T, e *env, b *Service, j1 scope.Join)
		check  func(t *testing.T, r *Resolved, err error)
	}{
		{"resolving member released", func(t *testing.T, e *env, b *Service, _ scope.Join) {
			_, _, err := b.Release(ctx, sc, "ses-1", 100)
			require.NoError(t, err)
		}, func(t *testing.T, r *Resolved, err error) {
			require.NoError(t, err)
			require.Equal(t, "ses-2", r.Member.SessionID, "resolves through the remaining member")
			require.Equal(t, "sk-2", string(r.Secret))
		}},
		{"last member leaves", func(t *testing.T, e *env, b *Service, _ scope.Join) {
			for _, s := range []string{"ses-1", "ses-2"} {
				_, _, err := b.Release(ctx, sc, s, 100)
				require.NoError(t, err)
			}
		}, refused(scope.ErrUnknownHandle)},
		{"wrapper restart retires", func(t *testing.T, e *env, b *Service, _ scope.Join) {
			_, err := b.Retire(ctx, sc, false, 100)
			require.NoError(t, err)
		}, refused(scope.ErrUnknownHandle)},
		{"retire with the last member", func(t *testing.T, e *env, b *Service, _ scope.Join) {
			_, err := b.Retire(ctx, sc, true, 100)
			require.NoError(t, err)
		}, refused(scope.ErrUnknownHandle)},
		{"rotation cuts the old handle to its overlap", func(t *testing.T, e *env, b *Service, _ scope.Join) {
			_, _, _, err := b.Rotate(ctx, sc, 100)
			require.NoError(t, err)
		}, refused(scope.ErrUnknownHandle)},
		{"backing credential deleted", func(t *testing.T, e *env, b *Service, j1 scope.Join) {
			require.NoError(t, b.DeleteCredential(ctx, j1.Member.CredentialRef))
		}, refused(scope.ErrNoLiveMember)},
		{"mint under another allocation", func(t *testing.T, e *env, b *Service, _ scope.Join) {
			j := e.join(t, 3, 100, "sk-3")
			j.AllocationID = "alloc-2"
			_, _, _, err := b.Mint(ctx, sc, j)
			require.NoError(t, err)
		}, refused(scope.ErrUnknownHandle)},
		{"member rejoins with another credential", func(t *testing.T, e *env, b *Service, _ scope.Join) {
			j := e.join(t, 1, 100, "sk-1-new")
			_, _, err := b.Adopt(ctx, sc, j)
			require.NoError(t, err)
		}, func(t *testing.T, r *Resolved, err error) {
			require.NoError(t, err)
			require.Equal(t, "sk-1-new", string(r.Secret), "no request after the rejoin uses the old credential")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			j1 := e.join(t, 1, 100, "sk-1")
			h, _, _, err := e.svc.Mint(ctx, sc, j1)
			require.NoError(t, err)
			_, _, err = e.svc.Adopt(ctx, sc, e.join(t, 2, 100, "sk-2"))
			require.NoError(t, err)
			r, err := e.svc.Resolve(ctx, h, "sbx-1") // cached on this replica
			require.NoError(t, err)
			require.Equal(t, "sk-1", string(r.Secret))
			_, err = e.svc.Resolve(ctx, h, "sbx-1") // served from the cache
			require.NoError(t, err)

			waits := e.waits.Load()
			c.revoke(t, e, e.replica(t, short), j1)
			require.Greater(t, e.waits.Load(), waits, "the revoking write waited")
			r, err = e.svc.Resolve(ctx, h, "sbx-1")
			c.check(t, r, err)
		})
	}

	t.Run("per-session handle replaced under a newer fence", func(t *testing.T) {
		e := newEnv(t)
		j := e.join(t, 1, 100, "sk-1")
		j.Contract = scope.PerSession
		h, _, _, err := e.svc.Mint(ctx, sc, j)
		require.NoError(t, err)
		_, err = e.svc.Resolve(ctx, h, "sbx-1")
		require.NoError(t, err)
		j.Fence = 101
		_, _, _, err = e.replica(t, policy).Mint(ctx, sc, j)
		require.NoError(t, err)
		_, err = e.svc.Resolve(ctx, h, "sbx-1")
		require.ErrorIs(t, err, scope.ErrUnknownHandle)
	})
}

func refused(want error) func(t *testing.T, r *Resolved, err error) {
	return func(t *testing.T, _ *Resolved, err error) { require.ErrorIs(t, err, want) }
}

// TestAddOnlyWritesDoNotWait: the sandbox's cold prepare path (store the
// credential, mint, siblings join) and idempotent mints never pay the
// revocation wait; a release does.
func TestAddOnlyWritesDoNotWait(t *testing.T) {
	e := newEnv(t)
	j1 := e.join(t, 1, 100, "sk-1")
	h, _, _, err := e.svc.Mint(ctx, sc, j1)
	require.NoError(t, err)
	_, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	_, _, err = e.svc.Adopt(ctx, sc, e.join(t, 2, 100, "sk-2"))
	require.NoError(t, err)
	_, _, _, err = e.svc.Mint(ctx, sc, j1)
	require.NoError(t, err)
	e.clock.Add(policy.GrantTTL - policy.ReissueBelow + time.Minute) // the next delivery reissues
	_, _, err = e.svc.Adopt(ctx, sc, e.join(t, 3, 100, "sk-3"))
	require.NoError(t, err)
	ps := e.join(t, 4, 100, "sk-4")
	ps.Contract = scope.PerSession
	_, _, _, err = e.svc.Mint(ctx, scope.Scope{SandboxID: "sbx-1", Directory: "/other"}, ps)
	require.NoError(t, err)
	_, _, _, err = e.svc.Mint(ctx, scope.Scope{SandboxID: "sbx-1", Directory: "/other"}, ps)
	require.NoError(t, err)
	require.Zero(t, e.waits.Load())

	_, _, err = e.svc.Release(ctx, sc, "ses-3", 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), e.waits.Load())
}

// TestSteadyUseRefreshesInBackground: a resolution used in the second half
// of its window is read again off the request path, so a handle in steady
// use never waits for Redis; one left unused past the window is read on the
// request path again.
func TestSteadyUseRefreshesInBackground(t *testing.T) {
	e := newEnv(t)
	h, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, "sk-1"))
	require.NoError(t, err)
	_, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	verifiedAt := func() time.Time { // zero: not cached
		if c, ok := e.svc.cache.Get(handle.DigestOf(h), e.svc.now()); ok {
			return c.verified
		}
		return time.Time{}
	}
	first := verifiedAt()
	require.False(t, first.IsZero(), "cached")

	e.clock.Add(trustWindow * 6 / 10)
	before := e.cmds.n.Load()
	_, err = e.svc.Resolve(ctx, h, "sbx-1") // served from the cache, starts a refresh
	require.NoError(t, err)
	require.Eventually(t, func() bool { return verifiedAt().After(first) }, 10*time.Second, time.Millisecond)
	require.Greater(t, e.cmds.n.Load(), before, "the refresh read Redis")

	e.clock.Add(trustWindow * 45 / 100) // past the first verification's window, in the first half of the refresh's
	before = e.cmds.n.Load()
	_, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	require.Equal(t, before, e.cmds.n.Load(), "served from the refreshed entry")

	e.clock.Add(trustWindow) // unused for a whole window
	_, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	require.Greater(t, e.cmds.n.Load(), before, "read on the request path")
}

// TestRefreshSeesAChangedScope: the background refresh renews a resolution
// only while the scope's version is unchanged; after another replica's
// write it resolves again.
func TestRefreshSeesAChangedScope(t *testing.T) {
	e := newEnv(t)
	h, _, _, err := e.svc.Mint(ctx, sc, e.join(t, 1, 100, "sk-1"))
	require.NoError(t, err)
	r, err := e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	require.Len(t, r.Grant.Members, 1)
	_, _, err = e.replica(t, policy).Adopt(ctx, sc, e.join(t, 2, 100, "sk-2")) // adds: no wait
	require.NoError(t, err)

	e.clock.Add(trustWindow * 6 / 10)
	r, err = e.svc.Resolve(ctx, h, "sbx-1")
	require.NoError(t, err)
	require.Len(t, r.Grant.Members, 1, "the cached resolution, at most one window old")
	require.Eventually(t, func() bool {
		c, ok := e.svc.cache.Get(handle.DigestOf(h), e.svc.now())
		return ok && len(c.r.Grant.Members) == 2
	}, 10*time.Second, time.Millisecond, "the refresh resolved the new version")
}

// TestLastReleaseLeavesNoScopeKey (issue 32): once the last member of a
// scope is released and the backing credentials are deleted, nothing of
// the scope is left in Redis: not its state, version or fence token, and
// not the digest index of any handle it minted (the rotated one too).
func TestLastReleaseLeavesNoScopeKey(t *testing.T) {
	e := newEnv(t)
	j1, j2 := e.join(t, 1, 100, "sk-1"), e.join(t, 2, 100, "sk-2")
	_, _, _, err := e.svc.Mint(ctx, sc, j1)
	require.NoError(t, err)
	_, _, err = e.svc.Adopt(ctx, sc, j2)
	require.NoError(t, err)
	_, _, _, err = e.svc.Rotate(ctx, sc, 100)
	require.NoError(t, err)
	require.NotEmpty(t, e.rdb.Keys(ctx, "cred:{hd:*").Val())

	_, _, err = e.svc.Release(ctx, sc, "ses-1", 100)
	require.NoError(t, err)
	require.NotEmpty(t, e.rdb.Keys(ctx, "cred:{hd:*").Val(), "the remaining member's handle still resolves")
	retired, remaining, err := e.svc.Release(ctx, sc, "ses-2", 100)
	require.NoError(t, err)
	require.True(t, retired)
	require.Zero(t, remaining)
	for _, j := range []scope.Join{j1, j2} {
		require.NoError(t, e.svc.DeleteCredential(ctx, j.Member.CredentialRef))
	}
	require.Empty(t, e.rdb.Keys(ctx, "*").Val(), "no key of the scope is left")

	// A repeated release (the deletion reconciler retries) is harmless and
	// leaves nothing either.
	_, _, err = e.svc.Release(ctx, sc, "ses-2", 100)
	require.NoError(t, err)
	require.Empty(t, e.rdb.Keys(ctx, "*").Val())
}

// TestUpdateOutlivesAConcurrentEmptying: a scope's keys, fence token
// included, go with its last member (TestLastReleaseLeavesNoScopeKey). A
// writer that observed its token just before another writer emptied the
// scope must write again under a fresh observation, not fail as stale: the
// churn soak's member releases failed STALE_FENCE_TOKEN that way, and their
// routes' runtimes were never stopped. A newer token is still refused.
func TestUpdateOutlivesAConcurrentEmptying(t *testing.T) {
	e := newEnv(t)
	j1 := e.join(t, 1, 100, "sk-1")
	_, _, _, err := e.svc.Mint(ctx, sc, j1)
	require.NoError(t, err)

	tokenKey := fence.TokenKey("cs:" + sc.ID())
	require.Equal(t, "100", e.rdb.Get(ctx, tokenKey).Val(), "the scope's fence token key (the test's view of the store)")
	emptied := false
	_, err = e.svc.update(ctx, sc, 100, false, func(*scope.State) error {
		if !emptied {
			emptied = true
			require.NoError(t, e.rdb.Del(ctx, tokenKey).Err(), "the other writer's emptying")
		}
		return nil
	})
	require.NoError(t, err, "written after observing the token again")
	require.Equal(t, "100", e.rdb.Get(ctx, tokenKey).Val())

	_, err = e.svc.update(ctx, sc, 100, false, func(*scope.State) error {
		return e.rdb.Set(ctx, tokenKey, "200", 0).Err() // a newer owner meanwhile
	})
	require.ErrorIs(t, err, ErrStaleFence, "a newer owner's token still wins")
}
