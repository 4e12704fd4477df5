// Package ownership keeps the owner lease of a sandbox: one sandbox-service
// replica drives a sandbox at a time. The lease is a pkg/fence lease on the
// resource named by the sandbox id, so every guarded write of sandbox state
// (keys sbx:{sandbox-id}:...) is checked against the owner's fencing token in
// the same Redis script. When Done closes the replica must stop driving the
// sandbox; another replica takes it over once the lease expires.
package ownership

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/fence"
)

// Resource is the sandbox's pkg/fence resource, "sbx/<id>": every service
// prefixes its fence resources, so a sandbox id chosen equal to a session id
// (or to another service's resource) never names that one's lease or token.
// Every key of the sandbox carries it as its hash tag.
func Resource(sandboxID string) string { return "sbx/" + sandboxID }

// ErrHeld means another replica owns the sandbox.
var ErrHeld = fence.ErrLeaseHeld

// Owner is this replica's hold on one sandbox.
type Owner struct {
	SandboxID string
	h         *fence.Holder
}

// Holder names the replica holding a sandbox's owner lease and the address
// callers reach it at (empty when the replica advertises none). The lease
// stores it as "replica@addr", so a caller that reads the lease, or gets
// it in a SANDBOX_OWNED_ELSEWHERE error, can send the call to the owner.
type Holder struct {
	Replica string
	Addr    string
}

// String is the holder as the lease stores it.
func (h Holder) String() string {
	if h.Addr == "" {
		return h.Replica
	}
	return h.Replica + "@" + h.Addr
}

// parseHolder reads a lease's owner field (replica names have no '@').
func parseHolder(s string) Holder {
	replica, addr, _ := strings.Cut(s, "@")
	return Holder{Replica: replica, Addr: addr}
}

// Acquire takes the owner lease of sandboxID for holder, renewed every
// ttl/3 until ctx ends, Release, or loss.
func Acquire(ctx context.Context, rdb redis.UniversalClient, sandboxID string, holder Holder, ttl time.Duration) (*Owner, error) {
	h, err := fence.Hold(ctx, rdb, Resource(sandboxID), holder.String(), ttl)
	if err != nil {
		return nil, err
	}
	return &Owner{SandboxID: sandboxID, h: h}, nil
}

// Resource is the owner lease's pkg/fence resource (Resource(SandboxID)).
func (o *Owner) Resource() string { return Resource(o.SandboxID) }

// Token is the fencing token every write of this owner carries.
func (o *Owner) Token() uint64 { return o.h.Token() }

// Done closes when the lease is lost or released.
func (o *Owner) Done() <-chan struct{} { return o.h.Done() }

// Unconfirmed reports whether the lease's deadline passed without a
// confirmed renewal (Redis unreachable or failing over): not lost, but
// another replica may have been granted it meanwhile (fence.Holder).
func (o *Owner) Unconfirmed() bool { return o.h.Unconfirmed() }

// Err says why Done closed (nil while held).
func (o *Owner) Err() error { return o.h.Err() }

// Guard runs a guarded write under the owner's token.
func (o *Owner) Guard(ctx context.Context, ops ...fence.Op) error { return o.h.Guard(ctx, ops...) }

// Release gives the sandbox up.
func (o *Owner) Release(ctx context.Context) error { return o.h.Release(ctx) }

// Current reads which replica owns sandboxID now ("" when nobody) and the
// newest token.
func Current(ctx context.Context, rdb redis.UniversalClient, sandboxID string) (string, uint64, error) {
	h, tok, err := CurrentHolder(ctx, rdb, sandboxID)
	return h.Replica, tok, err
}

// CurrentHolder reads who owns sandboxID now (zero Holder when nobody),
// with the address it advertised, and the newest token.
func CurrentHolder(ctx context.Context, rdb redis.UniversalClient, sandboxID string) (Holder, uint64, error) {
	v, err := rdb.Get(ctx, fence.LeaseKey(Resource(sandboxID))).Result()
	if errors.Is(err, redis.Nil) {
		return Holder{}, 0, nil
	}
	if err != nil {
		return Holder{}, 0, err
	}
	// A value that is not "<token>:<owner>" is not absence: report it, so
	// no caller takes over a sandbox it cannot prove is free.
	tok, owner, ok := strings.Cut(v, ":")
	t, err := strconv.ParseUint(tok, 10, 64)
	h := parseHolder(owner)
	if !ok || err != nil || t == 0 || h.Replica == "" {
		return Holder{}, 0, fmt.Errorf("ownership: malformed owner lease of sandbox %s", sandboxID)
	}
	return h, t, nil
}

// IsStale reports a write rejected because a newer owner holds the sandbox.
func IsStale(err error) bool {
	return errors.Is(err, fence.ErrStaleToken) || errors.Is(err, fence.ErrLeaseLost)
}
