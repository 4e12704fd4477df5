package driver

import (
	"context"
	"errors"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/store"
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
}

// UpdateEgress sets a route's egress policy when version is newer than the
// one it holds, with a write fenced by the owner token; once it returns
// true, every egress connection opened afterwards reads the new policy
// (EgressRoutes reads this replica's memory, which changed only after the
// fenced write succeeded). False: no such route yet (Prepare will carry
// the policy) or a newer version is in force.
func (d *Driver) UpdateEgress(ctx context.Context, sandboxID, sessionID string, p egresspolicy.Policy, version uint64) (bool, error) {
	sb, err := d.own(ctx, sandboxID)
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

// EgressWrapper authenticates an egress connection's wrapper as its Hello
// is (constant-time launch-credential digest, current allocation, still
// its runtime key's instance) and returns its runtime key.
// ErrEgressNotOwner: the sandbox is not this replica's to judge.
func (d *Driver) EgressWrapper(sandboxID, instance, credential string) (string, error) {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb == nil {
		return "", ErrEgressNotOwner
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
		return "", ErrEgressWrapperUnknown
	}
	if slot := sb.keyAllocations[w.RuntimeKey]; slot == nil || slot.Alloc.Instance != w.Instance || !slot.Alloc.Live() {
		return "", ErrEgressWrapperUnknown
	}
	return w.RuntimeKey, nil
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
		out = append(out, EgressRoute{Ref: d.ref(sb, id), RuntimeSessionID: r.RuntimeSessionID, Policy: r.Egress})
	}
	return out, nil
}
