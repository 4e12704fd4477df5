package grants

import (
	"context"
	"errors"
	"sync"

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
	version string
	entry   scope.Entry
}

// maxCached bounds the resolution cache; when full it starts over.
const maxCached = 16384

type resolutionCache struct {
	mu sync.RWMutex
	m  map[handle.Digest]*Resolved
}

func (c *resolutionCache) get(d handle.Digest) *Resolved {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.m[d]
}

func (c *resolutionCache) put(d handle.Digest, r *Resolved) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.m) >= maxCached {
		clear(c.m)
	}
	c.m[d] = r
}

func (c *resolutionCache) drop(d handle.Digest) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.m, d)
}

// dropScope forgets this process's resolutions of a scope after it wrote
// the scope. Correctness does not depend on it (every hit is checked against
// the stored version); it only saves the failed check.
func (c *resolutionCache) dropScope(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for d, r := range c.m {
		if r.scopeID == id {
			delete(c.m, d)
		}
	}
}

// Resolve checks raw's form (no store access for a malformed handle), then
// resolves it for a request made under sandboxID's proxy URL. A cached
// resolution costs one Redis round trip: the scope's version and the
// backing credential's existence, which every revoking write changes.
func (s *Service) Resolve(ctx context.Context, raw, sandboxID string) (*Resolved, error) {
	if _, err := handle.Parse(raw); err != nil {
		return nil, ErrMalformedHandle
	}
	d := handle.DigestOf(raw)
	now := s.now()
	if r := s.cache.get(d); r != nil {
		version, credOK, err := s.store.Freshness(ctx, r.scopeID, r.Member.CredentialRef)
		if err != nil {
			return nil, err
		}
		if version == r.version && credOK {
			switch {
			case !r.entry.Live(now):
				return nil, scope.ErrUnknownHandle
			case r.Grant.Scope.SandboxID != sandboxID:
				return nil, scope.ErrSandboxMismatch
			}
			return r, nil
		}
		s.cache.drop(d)
	}
	r, err := s.resolveFromStore(ctx, d, sandboxID)
	if err != nil {
		return nil, err
	}
	s.cache.put(d, r)
	return r, nil
}

func (s *Service) resolveFromStore(ctx context.Context, d handle.Digest, sandboxID string) (*Resolved, error) {
	id, err := s.store.ScopeOfDigest(ctx, d.String())
	if errors.Is(err, store.ErrNotFound) {
		return nil, scope.ErrUnknownHandle
	}
	if err != nil {
		return nil, err
	}
	st, version, err := s.store.LoadScope(ctx, id)
	if err != nil {
		return nil, err
	}
	if st == nil {
		return nil, scope.ErrUnknownHandle
	}
	res, err := st.Resolve(d, sandboxID, s.now())
	if err != nil {
		return nil, err
	}
	cred, err := s.store.GetCredential(ctx, res.Member.CredentialRef)
	if errors.Is(err, store.ErrNotFound) {
		return nil, scope.ErrNoLiveMember
	}
	if err != nil {
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
