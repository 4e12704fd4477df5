package driver

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// exhaustedWrappers: every runtime key's lease is exhausted and had its
// final observation; absence is never verified.
type exhaustedWrappers struct{ *heldWrappers }

func (exhaustedWrappers) AbsenceVerified(context.Context, string, string) (bool, time.Duration, error) {
	return false, 10 * time.Minute, nil
}
func (exhaustedWrappers) DeletionAllowed(context.Context, string, string) (bool, time.Duration, error) {
	return true, 0, nil
}
func (exhaustedWrappers) Lease(context.Context, string, string) (lease.Lease, error) {
	return lease.Lease{State: lease.StopNeeded, Exhausted: true, FinalObserved: true}, nil
}

// Issue 18 item 10: the release path consults DeletionAllowed for a session
// deletion only: an exhausted lease after its final observation lets the
// deletion complete (ExhaustedFinal, absence still not claimed); any other
// release keeps waiting for verified absence.
func TestReleaseRouteWiresTheExhaustedLeaseRule(t *testing.T) {
	wr := exhaustedWrappers{&heldWrappers{stopped: make(chan string, 8), launched: nil}}
	d := newTestDriver(t, &recordingProvider{launched: make(chan launchedWrapper, 1)}, wr, nil)
	t.Cleanup(d.dropAll)
	ctx := context.Background()

	rel, err := d.ReleaseRoute(ctx, "sbx-ex", "s1", ReasonSessionDelete)
	require.NoError(t, err)
	require.True(t, rel.ExhaustedFinal, "deletion allowed on the exhausted lease")
	require.False(t, rel.AbsenceVerified, "absence is not claimed")

	rel, err = d.ReleaseRoute(ctx, "sbx-ex", "s2", "session-stop")
	require.NoError(t, err)
	require.False(t, rel.ExhaustedFinal, "only a deletion may use the exception")
	require.False(t, rel.AbsenceVerified)
}

// Issue 33 item 8: Deliver read the route's state after releasing sb.mu,
// while the driver changes it under sb.mu (here: a preparation and its
// readiness flipping); -race reports the unsynchronized read.
func TestDeliverReadsTheRouteUnderTheLock(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, nil)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: "sbx-deliver", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	<-prov.launched
	d.mu.Lock()
	sb := d.sandboxes["sbx-deliver"]
	d.mu.Unlock()

	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 2000 {
			sb.mu.Lock()
			if r := sb.routes["s1"]; r != nil {
				if i%2 == 0 {
					r.State = store.RoutePreparing
				} else {
					r.State = store.RouteReady
				}
			}
			sb.mu.Unlock()
		}
	}()
	for range 200 {
		_, _, err := d.Deliver(ctx, "sbx-deliver", "s1", nil)
		require.NoError(t, err)
	}
	<-done
}

// flakyReleaseCredentials fails the first fails member releases (as the
// credential service did with STALE_FENCE_TOKEN when another writer emptied
// the scope meanwhile).
type flakyReleaseCredentials struct {
	rotatingCredentials
	fails atomic.Int32
}

func (c *flakyReleaseCredentials) ReleaseMember(context.Context, ScopeRef, string, uint64) error {
	if c.fails.Add(-1) >= 0 {
		return status.Error(codes.FailedPrecondition, "a newer sandbox owner fencing token was seen for this scope")
	}
	return nil
}

// stopTrackingWrappers: the key's wrapper runs (OwnsWrapper) until a stop is
// requested, and is verifiably absent only after that.
type stopTrackingWrappers struct {
	*heldWrappers
	stopRequested atomic.Bool
}

func (w *stopTrackingWrappers) RequestStop(context.Context, string, string, string) error {
	w.stopRequested.Store(true)
	return nil
}
func (w *stopTrackingWrappers) DeletionAllowed(ctx context.Context, sb, key string) (bool, time.Duration, error) {
	return w.AbsenceVerified(ctx, sb, key)
}
func (w *stopTrackingWrappers) AbsenceVerified(context.Context, string, string) (bool, time.Duration, error) {
	return w.stopRequested.Load(), time.Second, nil
}
func (w *stopTrackingWrappers) Lease(context.Context, string, string) (lease.Lease, error) {
	if w.stopRequested.Load() {
		return lease.Lease{State: lease.None}, nil
	}
	return lease.Lease{State: lease.OwnsWrapper}, nil
}

// Issue 33 (the churn soak): the first release of a key's last member
// returned before requesting the wrapper's stop when its member release
// failed, and every repeat (rel.first false) skipped the stop: the deletion
// stayed DELETION_PENDING_CLEANUP with the wrapper running. A repeat now
// asks for the stop once the member is released.
func TestReleaseAfterAFailedMemberReleaseStopsTheWrapper(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 1)}
	wr := &stopTrackingWrappers{heldWrappers: &heldWrappers{launched: map[string]provider.Markers{}}}
	creds := &flakyReleaseCredentials{}
	creds.fails.Store(1)
	d := newTestDriver(t, prov, wr, creds)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: "sbx-flaky", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	<-prov.launched

	rel, err := d.ReleaseRoute(ctx, "sbx-flaky", "s1", ReasonSessionDelete)
	require.NoError(t, err)
	require.False(t, rel.AbsenceVerified, "the member is not released yet")
	require.False(t, wr.stopRequested.Load(), "no stop before the member release")

	rel, err = d.ReleaseRoute(ctx, "sbx-flaky", "s1", ReasonSessionDelete)
	require.NoError(t, err)
	require.True(t, wr.stopRequested.Load(), "the repeat asks for the wrapper's stop")
	require.True(t, rel.AbsenceVerified, "and the deletion can finish: %+v", rel)
}
