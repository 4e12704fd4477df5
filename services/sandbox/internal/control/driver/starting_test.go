package driver

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// goneWrappers forgets a key's wrapper when told it is gone, as the
// reconciler's lease does, so the next EnsureWrapper launches again.
type goneWrappers struct {
	heldWrappers
	gone chan string // instances reported gone
}

func (w *goneWrappers) WrapperGone(_ context.Context, _, key, instance string) error {
	w.mu.Lock()
	delete(w.launched, key)
	w.mu.Unlock()
	w.gone <- instance
	return nil
}

// presentProvider discovers every launched wrapper as running.
type presentProvider struct{ recordingProvider }

func (p *presentProvider) Discover(_ context.Context, _, key string) provider.Discovery {
	return provider.Discovery{Kind: provider.Present, Observed: []provider.Observed{{InstanceID: "wi-1", Generation: 1}}}
}

func startingKey(t *testing.T, prov provider.AgentSandbox, launched chan launchedWrapper) (*Driver, *goneWrappers, *sandbox) {
	t.Helper()
	wr := &goneWrappers{heldWrappers: heldWrappers{stopped: make(chan string, 8), launched: map[string]provider.Markers{}}, gone: make(chan string, 8)}
	d := newTestDriver(t, prov, wr, nil)
	t.Cleanup(d.dropAll)
	_, err := d.Prepare(context.Background(), RouteSpec{SessionID: "s1", SandboxID: "sbx-start", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	w := <-launched
	require.Equal(t, "wi-1", w.markers.InstanceID)
	d.mu.Lock()
	sb := d.sandboxes["sbx-start"]
	d.mu.Unlock()
	require.Eventually(t, func() bool { // the launch returned; no Hello came
		sb.mu.Lock()
		defer sb.mu.Unlock()
		s := sb.keyAllocations["/repo"]
		return s != nil && s.Alloc.Phase == allocation.Starting && sb.launching["/repo"] == 0
	}, 10*time.Second, time.Millisecond)
	return d, wr, sb
}

// TestStartingKeyWhoseWrapperIsGoneRelaunches: a starting runtime key that
// no launch here is making, and whose wrapper discovery verifies absent (a
// pooled wrapper whose service died before its claim reached it), is gone
// at the next tick, not after the Hello timeout: the lease is told, and the
// route's preparation launches a new wrapper.
func TestStartingKeyWhoseWrapperIsGoneRelaunches(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	d, wr, _ := startingKey(t, prov, prov.launched)
	d.tick(context.Background())
	select {
	case inst := <-wr.gone:
		require.Equal(t, "wi-1", inst)
	case <-time.After(10 * time.Second):
		t.Fatal("the starting key's absent wrapper was not found gone")
	}
	for range 50 {
		d.tick(context.Background()) // the stop completes, the route prepares again
		select {
		case w := <-prov.launched:
			require.Equal(t, "wi-2", w.markers.InstanceID, "a new wrapper for the route")
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Fatal("the route did not launch again")
}

// TestStartingKeyWhoseWrapperRunsWaitsForItsHello: the same key with its
// wrapper running is left to say Hello.
func TestStartingKeyWhoseWrapperRunsWaitsForItsHello(t *testing.T) {
	prov := &presentProvider{recordingProvider{launched: make(chan launchedWrapper, 4)}}
	d, wr, sb := startingKey(t, prov, prov.launched)
	for range 3 {
		d.tick(context.Background())
	}
	require.Empty(t, wr.gone)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	require.Equal(t, allocation.Starting, sb.keyAllocations["/repo"].Alloc.Phase)
}
