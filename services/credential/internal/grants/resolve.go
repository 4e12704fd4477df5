package grants

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"agentplane.dev/pkg/expiring"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
	"agentplane.dev/services/credential/internal/store"
)

// Resolved is a handle resolved through a live member, with the backing
// secret opened. It is shared by cached lookups: treat it as read-only.
type Resolved struct {
	Grant        Grant
	Member       scope.Member
	Secret       []byte
	SecretDigest string

	scopeID string
	version string // of the scope state it was resolved from
	entry   scope.Entry
}

// cached is a resolution and when the reads that produced it were sent.
type cached struct {
	r          *Resolved
	verified   time.Time
	refreshing atomic.Bool // a background refresh is under way
}

// maxCached bounds the resolution cache.
const maxCached = 16384

// sweepEvery is how often a put drops the resolutions past the trust window,
// which are never used again (a request reads such a handle afresh): else
// every handle ever resolved, most of them released with their session,
// stays until maxCached pushes it out.
const sweepEvery = time.Second

// newCache keys resolutions by digest, stamped when their reads were sent.
func newCache(window time.Duration) *expiring.Map[handle.Digest, *cached] {
	return expiring.New[handle.Digest, *cached](expiring.Options{TTL: window, SweepEvery: sweepEvery, Max: maxCached})
}

// dropScope forgets this process's resolutions of a scope after it wrote
// the scope, so that its own additions show at once. Revocation does not
// depend on it (the writer waits out every replica's cache).
func (s *Service) dropScope(id string) {
	s.cache.DeleteFunc(func(_ handle.Digest, e *cached) bool { return e.r.scopeID == id })
}

// trusted reports whether a resolution verified at v may still be used at
// now: within the window on the monotonic clock, and on the wall clock too,
// which a suspended host (its monotonic clock stopped) steps forward on
// resume.
func (s *Service) trusted(v, now time.Time) bool {
	return now.Sub(v) < s.window && now.Round(0).Sub(v.Round(0)) < s.window
}

// Resolve checks raw's form (no store access for a malformed handle), then
// resolves it for a request made under sandboxID's proxy URL. A resolution
// cached less than the trust window ago costs no Redis command; one used in
// the second half of its window is read again in the background, so a
// handle in steady use is never read on a request's path. A refusal
// always comes from Redis, a sandbox mismatch too (a cached answer would
// be faster, and tell the sandboxes apart by timing): a cached entry past
// its own expiry is read again, it may have been reissued.
func (s *Service) resolve(ctx context.Context, raw, sandboxID string) (*Resolved, error) {
	if _, err := handle.Parse(raw); err != nil {
		return nil, ErrMalformedHandle
	}
	d := handle.DigestOf(raw)
	now := s.now() // before the reads: the trust window starts here
	// A cached resolution under another sandbox's URL is refused through
	// the store like every other refusal, not at once from the cache.
	if c, ok := s.cache.Get(d, now); ok && s.trusted(c.verified, now) && c.r.entry.Live(now) && c.r.Grant.Scope.SandboxID == sandboxID {
		if now.Sub(c.verified) >= s.window/2 && c.refreshing.CompareAndSwap(false, true) {
			go s.refresh(d, c.r, sandboxID)
		}
		return c.r, nil
	}
	r, err := s.resolveFromStore(ctx, d, sandboxID)
	if err != nil {
		if !errors.Is(err, scope.ErrSandboxMismatch) { // the handle's own sandbox keeps its cached resolution
			s.cache.Delete(d)
		}
		return nil, err
	}
	if s.window > 0 {
		s.cache.Put(d, &cached{r: r, verified: now}, now)
	}
	return r, nil
}

// refresh verifies a cached resolution again off the request path: one
// round trip renews it while the scope's version is unchanged (versions
// never repeat) and its backing credential exists (a credential is never
// rewritten); otherwise it is resolved again. A result that took longer
// than the window would already be untrusted, hence the timeout; a failure
// or refusal drops the entry (the next request reads).
func (s *Service) refresh(d handle.Digest, old *Resolved, sandboxID string) {
	ctx, cancel := context.WithTimeout(context.Background(), s.window)
	defer cancel()
	now := s.now()
	r := old
	version, credOK, err := s.store.Freshness(ctx, old.scopeID, old.Member.CredentialRef)
	if err == nil && (version != old.version || !credOK) {
		r, err = s.resolveFromStore(ctx, d, sandboxID)
	}
	if err != nil {
		s.cache.Delete(d)
		return
	}
	s.cache.Put(d, &cached{r: r, verified: now}, now)
}

// absentKey names a scope and a credential that never exist (no scope id
// or credential ref is empty): a refusal reads them in place of the ones it
// did not find, so that every refusal costs the same three reads.
const absentKey = ""

// resolveFromStore reads the digest's scope, the scope's state and the
// resolving member's backing credential. Every refusal (unknown, expired,
// retired, no live member, another sandbox's) makes all three reads, the
// missing ones on absentKey, so its answer takes as long as any other
// refusal's and its timing does not tell which it was (issue 19). Only a
// store failure returns early.
func (s *Service) resolveFromStore(ctx context.Context, d handle.Digest, sandboxID string) (*Resolved, error) {
	var refused error
	id, err := s.store.ScopeOfDigest(ctx, d.String())
	switch {
	case errors.Is(err, store.ErrNotFound):
		id, refused = absentKey, scope.ErrUnknownHandle
	case err != nil:
		return nil, err
	}
	st, version, err := s.store.LoadScope(ctx, id)
	if err != nil {
		return nil, err
	}
	var res scope.Resolution
	switch {
	case refused != nil:
	case st == nil:
		refused = scope.ErrUnknownHandle
	default:
		res, err = st.Resolve(d, sandboxID, s.now())
		refused = err
	}
	ref := res.Member.CredentialRef
	if refused != nil {
		ref = absentKey
	}
	cred, err := s.store.GetCredential(ctx, ref)
	switch {
	case refused != nil:
		return nil, refused
	case errors.Is(err, store.ErrNotFound):
		return nil, scope.ErrNoLiveMember
	case err != nil:
		return nil, err
	}
	secret, err := s.sealer.Open(cred.Sealed, "credential:"+res.Member.CredentialRef)
	if err != nil {
		return nil, err
	}
	return &Resolved{
		Grant: grantOf(st, res.Entry), Member: res.Member, Secret: secret, SecretDigest: cred.SecretDigest,
		scopeID: id, version: version, entry: res.Entry,
	}, nil
}
