package driver

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// ErrEgressWrapperUnknown: an egress connection's preamble names no
// current wrapper of a sandbox this replica owns, or its credential does
// not verify.
var ErrEgressWrapperUnknown = errors.New("driver: egress: no such current wrapper")

// ErrEgressNotOwner: an egress connection's preamble names a sandbox this
// replica does not own (another replica of the node may).
var ErrEgressNotOwner = errors.New("driver: egress: the sandbox is not owned here")

// EgressRoute is what the egress proxy needs of a route its runtime serves:
// the session's policy and where its audit events go.
type EgressRoute struct {
	Ref              RouteRef
	RuntimeSessionID string
	Policy           egresspolicy.Policy
	// ExpectsDenial reports whether the route's agent profile expects
	// denials of a host (agents.Registry.ExpectsDenial).
	ExpectsDenial func(host string) bool
}

// UpdateEgress sets a route's egress policy when version is newer than the
// one it holds, with a write fenced by the owner token; once it returns
// true, every egress connection opened afterwards reads the new policy
// (EgressRoutes reads this replica's memory, which changed only after the
// fenced write succeeded). False: no such route yet (Prepare will carry
// the policy) or a newer version is in force.
func (d *Driver) UpdateEgress(ctx context.Context, sandboxID, sessionID string, p egresspolicy.Policy, version uint64) (bool, error) {
	sb, err := d.ownStored(ctx, sandboxID)
	if errors.Is(err, ErrRouteNotFound) {
		return false, nil // no route yet: Prepare will carry the policy
	}
	if err != nil {
		return false, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	r := sb.routes[sessionID]
	if r == nil || r.State == store.RouteReleased || version <= r.EgressVersion {
		return false, nil
	}
	next := *r
	next.Egress, next.EgressVersion, next.Updated = p, version, d.cfg.Now()
	if err := store.PutRoute(ctx, sb.owner, sb.id, &next); err != nil {
		d.staleWrite(sb, err)
		return false, err
	}
	*r = next
	return true, nil
}

// takeEgressLocked adopts a repeated Prepare's policy when it is newer
// (the session's update may have reached the sandbox only this way).
func (d *Driver) takeEgressLocked(sb *sandbox, r *store.Route, p egresspolicy.Policy, version uint64) {
	if version <= r.EgressVersion {
		return
	}
	r.Egress, r.EgressVersion = p, version
	d.persistRoute(sb, r)
}

// EgressGrant is what an authenticated egress connection is served under:
// its wrapper's runtime key, and the owner token this replica holds the
// sandbox with (a new token is a new ownership: what this replica knew of
// the sandbox's byte window from before may be stale).
type EgressGrant struct {
	RuntimeKey string
	OwnerToken uint64
}

// EgressWrapper authenticates an egress connection's wrapper as its Hello
// is (constant-time launch-credential digest, current allocation, still
// its runtime key's instance).
// ErrEgressNotOwner: the sandbox is not this replica's to judge.
func (d *Driver) EgressWrapper(sandboxID, instance, credential string) (EgressGrant, error) {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb == nil {
		return EgressGrant{}, ErrEgressNotOwner
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	w := sb.wrappers[instance]
	got := digest(credential)
	want := make([]byte, len(got))
	if w != nil {
		want = w.CredDigest
	}
	if !constantTimeEqual(got, want) || w == nil || w.Allocation != sb.allocationID {
		return EgressGrant{}, ErrEgressWrapperUnknown
	}
	if slot := sb.keyAllocations[w.RuntimeKey]; slot == nil || slot.Alloc.Instance != w.Instance || !slot.Alloc.Live() {
		return EgressGrant{}, ErrEgressWrapperUnknown
	}
	return EgressGrant{RuntimeKey: w.RuntimeKey, OwnerToken: sb.owner.Token()}, nil
}

// EgressWindow reads the sandbox's egress byte window as its owner last
// saved it (a previous owner's, after a takeover).
func (d *Driver) EgressWindow(ctx context.Context, sandboxID string) (store.EgressWindow, error) {
	return store.LoadEgressWindow(ctx, d.cfg.Redis, sandboxID)
}

// SaveEgressWindow saves the sandbox's byte window until ends, fenced by
// the owner token. ErrEgressNotOwner: this replica does not own it (any
// more); a stale token also drops the sandbox, as every fenced write's.
func (d *Driver) SaveEgressWindow(ctx context.Context, sandboxID string, w store.EgressWindow, ends time.Time) error {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb == nil {
		return ErrEgressNotOwner
	}
	if err := store.PutEgressWindow(ctx, sb.owner, sandboxID, w, ends); err != nil {
		d.staleWrite(sb, err)
		return err
	}
	return nil
}

// EgressRoutes returns the routes a runtime key serves now (sessions that
// share the runtime share its egress: the union of their policies).
func (d *Driver) EgressRoutes(sandboxID, key string) ([]EgressRoute, error) {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb == nil {
		return nil, ErrEgressWrapperUnknown
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	var out []EgressRoute
	for id, r := range sb.routes {
		if r.RuntimeKey != key || r.State == store.RouteReleased || r.State == store.RouteFailed {
			continue
		}
		profile := r.Agent.Profile
		out = append(out, EgressRoute{Ref: d.ref(sb, id), RuntimeSessionID: r.RuntimeSessionID, Policy: r.Egress,
			ExpectsDenial: func(host string) bool { return d.cfg.Agents.ExpectsDenial(profile, host) }})
	}
	return out, nil
}
