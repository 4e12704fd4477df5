// Package grants runs the credential lifecycle: it stores backing
// credentials sealed, issues handles, applies the scope rules under the
// sandbox owner's fencing token, and resolves handles for the proxy.
//
// Resolutions are cached per process and trusted without Redis for
// TrustWindow, counted on the monotonic clock from just before the Redis
// read that verified them (docs/decisions.md #16: revocation by waiting out
// the resolution caches). Every write that can take away something a cached
// resolution allows (a member released, entries retired, a rotation cutting
// the old handle to its overlap, a backing credential deleted, a mint that
// narrows the scope) waits TrustWindow plus a clock-rate margin after its
// Redis write before it returns. Any resolution cached on any replica was
// verified by a read before that write, so it has expired everywhere when
// the revoking call returns: a revocation holds for every request that
// starts after it returned. Writes that only add (a first mint, a join, an
// idempotent mint, a reissue) do not wait.
package grants

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/expiring"
	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/pause"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
	"agentplane.dev/services/credential/internal/sealer"
	"agentplane.dev/services/credential/internal/store"
)

// Errors of the service besides the scope rules' and the store's.
var (
	ErrCredentialNotFound = errors.New("backing credential not found")
	ErrClassMismatch      = errors.New("credential class does not match the stored credential")
	ErrBusy               = errors.New("scope kept changing; retry")
	ErrStaleFence         = errors.New("fencing token older than the scope's newest")
	ErrMalformedHandle    = handle.ErrMalformed
)

// maxAttempts bounds compare-and-set retries of one scope write.
const maxAttempts = 32

// Options configure a Service.
type Options struct {
	Policy scope.Policy
	Now    func() time.Time // injected in tests; time.Now otherwise
	// TrustWindow is how long a cached resolution is used without Redis;
	// zero resolves every request from Redis and no write waits.
	TrustWindow time.Duration
	// Wait pauses a revoking write until the caches it could contradict
	// have expired; injected in tests (a context-aware timer otherwise).
	Wait func(ctx context.Context, d time.Duration) error
}

// Service is the credential lifecycle.
type Service struct {
	store  *store.Store
	sealer *sealer.Sealer
	policy scope.Policy
	now    func() time.Time
	window time.Duration
	wait   func(ctx context.Context, d time.Duration) error
	cache  *expiring.Map[handle.Digest, *cached]
	obs    *Metrics // nil until Observe (metrics.go)
}

// outlastCaches returns once every resolution any replica verified before
// the caller's write returned has expired. The 10% margin covers the
// replicas' monotonic clocks running at different rates (NTP keeps them
// within 0.05%); timers never fire early.
func (s *Service) outlastCaches(ctx context.Context) error {
	if s.window <= 0 {
		return nil
	}
	return s.wait(ctx, s.window+s.window/10)
}

// New builds a service on rdb with the at-rest key.
func New(rdb redis.UniversalClient, key []byte, opts Options) (*Service, error) {
	sl, err := sealer.New(key)
	if err != nil {
		return nil, err
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Wait == nil {
		opts.Wait = pause.Sleep
	}
	return &Service{store: store.New(rdb), sealer: sl, policy: opts.Policy, now: opts.Now,
		window: opts.TrustWindow, wait: opts.Wait, cache: newCache(opts.TrustWindow)}, nil
}

// Grant describes a handle without revealing it.
type Grant struct {
	Digest   string
	Kind     handle.Kind
	Scope    scope.Scope
	Issuer   string
	Class    scope.Class
	Members  []scope.Member
	ExpireAt time.Time
	Fence    uint64
}

func grantOf(st *scope.State, e scope.Entry) Grant {
	return Grant{Digest: e.Digest, Kind: e.Kind, Scope: st.Scope, Issuer: e.Issuer, Class: st.Class,
		Members: append([]scope.Member(nil), st.Members...), ExpireAt: e.ExpireAt, Fence: e.AcceptedFence}
}

// SecretDigest is the hex SHA-256 of a backing secret.
func SecretDigest(secret []byte) string {
	sum := sha256.Sum256(secret)
	return hex.EncodeToString(sum[:])
}

func newRef() string {
	var b [18]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return "cr_" + base64.RawURLEncoding.EncodeToString(b[:])
}

// PutCredential stores secret sealed and returns its reference and digest.
func (s *Service) PutCredential(ctx context.Context, sessionID string, class scope.Class, secret []byte) (ref, digest string, err error) {
	ref, digest = newRef(), SecretDigest(secret)
	c := store.Credential{Class: class, SessionID: sessionID, SecretDigest: digest, Sealed: s.sealer.Seal(secret, "credential:"+ref)}
	if err := s.store.PutCredential(ctx, ref, c); err != nil {
		return "", "", err
	}
	return ref, digest, nil
}

// PutGitCredential stores a git token sealed, bound to the repository it
// is for and the branch prefix its pushes are confined to, and returns its
// reference and digest.
func (s *Service) PutGitCredential(ctx context.Context, sessionID, repoURL, username, pushPrefix string, token []byte) (ref, digest string, err error) {
	ref, digest = newRef(), SecretDigest(token)
	c := store.Credential{Class: scope.Static, SessionID: sessionID, SecretDigest: digest, Sealed: s.sealer.Seal(token, "credential:"+ref),
		RepoURL: repoURL, GitUsername: username, PushPrefix: pushPrefix}
	if err := s.store.PutCredential(ctx, ref, c); err != nil {
		return "", "", err
	}
	return ref, digest, nil
}

// GitAccess is an opened git credential.
type GitAccess struct {
	RepoURL, Username string
	PushPrefix        string // "": the proxy's default
	Token             []byte
}

// ErrNotGitCredential: the reference names no git credential.
var ErrNotGitCredential = errors.New("credential: not a git credential")

// GitCredential opens the git credential ref (for the proxy's git route).
func (s *Service) GitCredential(ctx context.Context, ref string) (GitAccess, error) {
	c, err := s.store.GetCredential(ctx, ref)
	if errors.Is(err, store.ErrNotFound) {
		return GitAccess{}, ErrCredentialNotFound
	}
	if err != nil {
		return GitAccess{}, err
	}
	if c.RepoURL == "" {
		return GitAccess{}, ErrNotGitCredential
	}
	tok, err := s.sealer.Open(c.Sealed, "credential:"+ref)
	if err != nil {
		return GitAccess{}, err
	}
	return GitAccess{RepoURL: c.RepoURL, Username: c.GitUsername, PushPrefix: c.PushPrefix, Token: tok}, nil
}

// DeleteCredential deletes a backing credential and returns once no cached
// resolution uses it. It always waits, even when the credential was already
// gone: a concurrent or earlier delete may still be waiting.
func (s *Service) DeleteCredential(ctx context.Context, ref string) error {
	if err := s.store.DeleteCredential(ctx, ref); err != nil {
		return err
	}
	return s.outlastCaches(ctx)
}

func (s *Service) checkCredential(ctx context.Context, ref string, class scope.Class) error {
	c, err := s.store.GetCredential(ctx, ref)
	if errors.Is(err, store.ErrNotFound) {
		return ErrCredentialNotFound
	}
	if err != nil {
		return err
	}
	if c.Class != class {
		return ErrClassMismatch
	}
	return nil
}

func (s *Service) candidate(kind handle.Kind, sc scope.Scope) (string, scope.Candidate, error) {
	raw, err := handle.New(kind)
	if err != nil {
		return "", scope.Candidate{}, err
	}
	d := handle.DigestOf(raw).String()
	return raw, scope.Candidate{Digest: d, Sealed: s.sealer.Seal([]byte(raw), handleContext(sc, d))}, nil
}

func handleContext(sc scope.Scope, digest string) string { return "handle:" + sc.ID() + ":" + digest }

// rawOf opens the sealed raw handle of an entry for re-delivery.
func (s *Service) rawOf(sc scope.Scope, e scope.Entry) (string, error) {
	raw, err := s.sealer.Open(e.Sealed, handleContext(sc, e.Digest))
	if err != nil {
		return "", fmt.Errorf("open sealed handle: %w", err)
	}
	return string(raw), nil
}

// update applies fn to the scope's state under token: it records the token
// as the scope's newest (refusing older ones), then reads, applies and
// compare-and-sets until no concurrent write interferes. fn's error writes
// nothing. A revoking write, or one whose result narrows the state it
// replaced, returns only after outlastCaches.
func (s *Service) update(ctx context.Context, sc scope.Scope, token uint64, revoking bool, fn func(st *scope.State) error) (*scope.State, error) {
	id := sc.ID()
	if err := s.store.ObserveFence(ctx, id, token); err != nil {
		return nil, mapStoreErr(err)
	}
	for range maxAttempts {
		st, version, err := s.store.LoadScope(ctx, id)
		if err != nil {
			return nil, err
		}
		if st == nil {
			st = &scope.State{Scope: sc}
		}
		before := st.Clone()
		if err := fn(st); err != nil {
			return nil, err
		}
		_, err = s.store.SaveScope(ctx, id, token, version, st)
		if errors.Is(err, store.ErrConflict) {
			continue
		}
		if errors.Is(err, fence.ErrStaleToken) {
			// Another writer emptied the scope meanwhile, and its keys went
			// with its last member, fence token included: observe the token
			// again (refused if a newer one is there) and start over.
			if err := s.store.ObserveFence(ctx, id, token); err != nil {
				return nil, mapStoreErr(err)
			}
			continue
		}
		if err != nil {
			return nil, mapStoreErr(err)
		}
		s.dropScope(id)
		// A dropped entry's digest resolves to nothing now: its index key
		// goes. Best effort: the state is written, and a key a failed DEL
		// keeps expires with its grant (index) and resolves to no entry.
		_ = s.store.UnindexDigests(ctx, droppedDigests(before, st))
		if revoking || scope.Narrows(before, st) {
			if err := s.outlastCaches(ctx); err != nil {
				return nil, err
			}
		}
		return st, nil
	}
	return nil, ErrBusy
}

// droppedDigests lists the digests of before's entries that after no longer has.
func droppedDigests(before, after *scope.State) []string {
	kept := make(map[string]bool, len(after.Entries))
	for _, e := range after.Entries {
		kept[e.Digest] = true
	}
	var out []string
	for _, e := range before.Entries {
		if !kept[e.Digest] {
			out = append(out, e.Digest)
		}
	}
	return out
}

func (s *Service) index(ctx context.Context, sc scope.Scope, e scope.Entry) error {
	ttl := e.ExpireAt.Sub(s.now()) + s.policy.OverlapWindow + time.Minute
	return s.store.IndexDigest(ctx, e.Digest, sc.ID(), ttl)
}

// Mint returns the scope's handle for the joining member (see scope.Mint).
func (s *Service) Mint(ctx context.Context, sc scope.Scope, j scope.Join) (string, Grant, bool, error) {
	if err := s.checkCredential(ctx, j.Member.CredentialRef, j.Class); err != nil {
		return "", Grant{}, false, err
	}
	kind := handle.Worktree
	if j.Contract == scope.PerSession {
		kind = handle.PerSession
	}
	raw, cand, err := s.candidate(kind, sc)
	if err != nil {
		return "", Grant{}, false, err
	}
	var res scope.Result
	st, err := s.update(ctx, sc, j.Fence, false, func(st *scope.State) error {
		var err error
		res, err = st.Mint(j, cand, s.now(), s.policy)
		return err
	})
	if err != nil {
		return "", Grant{}, false, err
	}
	if !res.Minted {
		if raw, err = s.rawOf(sc, res.Entry); err != nil {
			return "", Grant{}, false, err
		}
	}
	if err := s.index(ctx, sc, res.Entry); err != nil {
		return "", Grant{}, false, err
	}
	return raw, grantOf(st, res.Entry), res.Adopted, nil
}

// Adopt gives a joining sibling the accepted canonical handle.
func (s *Service) Adopt(ctx context.Context, sc scope.Scope, j scope.Join) (string, Grant, error) {
	if err := s.checkCredential(ctx, j.Member.CredentialRef, j.Class); err != nil {
		return "", Grant{}, err
	}
	var res scope.Result
	st, err := s.update(ctx, sc, j.Fence, false, func(st *scope.State) error {
		var err error
		res, err = st.Adopt(j, s.now(), s.policy)
		return err
	})
	if err != nil {
		return "", Grant{}, err
	}
	raw, err := s.rawOf(sc, res.Entry)
	if err != nil {
		return "", Grant{}, err
	}
	if err := s.index(ctx, sc, res.Entry); err != nil {
		return "", Grant{}, err
	}
	return raw, grantOf(st, res.Entry), nil
}

// Rotate replaces the scope's canonical handle for every member at once. It
// cuts the old handle to its overlap, so it waits out the caches.
func (s *Service) rotate(ctx context.Context, sc scope.Scope, token uint64) (string, Grant, time.Time, error) {
	raw, cand, err := s.candidate(handle.Worktree, sc)
	if err != nil {
		return "", Grant{}, time.Time{}, err
	}
	var e scope.Entry
	var until time.Time
	st, err := s.update(ctx, sc, token, true, func(st *scope.State) error {
		var err error
		e, until, err = st.Rotate(token, cand, s.now(), s.policy)
		return err
	})
	if err != nil {
		return "", Grant{}, time.Time{}, err
	}
	if err := s.index(ctx, sc, e); err != nil {
		return "", Grant{}, time.Time{}, err
	}
	return raw, grantOf(st, e), until, nil
}

// Release removes a member; the last one retires the scope. It waits out
// the caches, even when the member was already gone.
func (s *Service) Release(ctx context.Context, sc scope.Scope, sessionID string, token uint64) (bool, int, error) {
	var retired bool
	var remaining int
	_, err := s.update(ctx, sc, token, true, func(st *scope.State) error {
		retired, remaining = st.Release(sessionID)
		return nil
	})
	return retired, remaining, err
}

// Retire drops every accepted handle of the scope; lastMember drops the
// members too. It waits out the caches.
func (s *Service) retire(ctx context.Context, sc scope.Scope, lastMember bool, token uint64) (int, error) {
	var n int
	_, err := s.update(ctx, sc, token, true, func(st *scope.State) error {
		n = st.Retire(lastMember)
		return nil
	})
	return n, err
}

// CheckMember tells whether rsid is a live member root of the scope.
func (s *Service) CheckMember(ctx context.Context, sc scope.Scope, rsid string) (scope.Member, bool, error) {
	st, _, err := s.store.LoadScope(ctx, sc.ID())
	if err != nil || st == nil {
		return scope.Member{}, false, err
	}
	m, ok := st.MemberByRoot(rsid)
	return m, ok, nil
}

// State returns a scope's stored state (nil if none), for inspection.
func (s *Service) State(ctx context.Context, sc scope.Scope) (*scope.State, error) {
	st, _, err := s.store.LoadScope(ctx, sc.ID())
	return st, err
}

func mapStoreErr(err error) error {
	if err != nil && errors.Is(err, fence.ErrStaleToken) {
		return ErrStaleFence
	}
	return err
}
