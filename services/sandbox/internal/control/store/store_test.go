package store

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/ownership"
	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/scope"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(redistest.Shared(m)) }

var now = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func routeRecord(sessionID string, state route.State) *Route {
	return &Route{SessionID: sessionID, Route: route.Route{Directory: "/src/app", State: state, RuntimeSessionID: "rs-" + sessionID,
		RuntimeKey: "k1", Contract: scope.PerSession, WrapperInstance: "w1"}, RepoURL: "https://git.example/app", UserID: "u1", OrgID: "o1",
		CredentialRef: "cred-ref", CredentialClass: "user", Updated: now}
}

// sandboxState is one of each record of sandbox sb1.
func sandboxState() Snapshot {
	return Snapshot{
		AllocationID: "alloc-1",
		Routes:       map[string]*Route{"s1": routeRecord("s1", RouteReady), "s2": routeRecord("s2", RoutePreparing)},
		Scopes: map[string]*scope.Scope{"/src/app": {SandboxID: "sb1", Directory: "/src/app", Contract: scope.PerSession,
			Class: "user", Members: map[string]string{"s1": "rs-s1"}}},
		Wrappers: map[string]*Wrapper{"w1": {Instance: "w1", RuntimeKey: "k1", Allocation: "alloc-1", Generation: 2,
			FenceToken: 9, CredDigest: []byte{0xde, 0xad, 0xbe, 0xef}}},
		KeyAllocations: map[string]*KeyAllocation{
			"k1": {RuntimeKey: "k1", Directory: "/src/app", Alloc: allocation.Allocation{Phase: allocation.Connected, LastHeartbeat: now, Instance: "w1"}},
			"k2": {RuntimeKey: "k2", Directory: "/src/lib", Alloc: allocation.Allocation{Phase: allocation.Disconnected, Deadline: now, Reason: "heartbeat"}},
			"k3": {RuntimeKey: "k3", Directory: "/src/doc", Alloc: allocation.Allocation{Phase: allocation.Stopping}},
		},
	}
}

// put writes s for sandbox sb1 through every Put function.
func put(ctx context.Context, w Writer, s Snapshot) error {
	if err := PutMeta(ctx, w, "sb1", s.AllocationID); err != nil {
		return err
	}
	for _, r := range s.Routes {
		if err := PutRoute(ctx, w, "sb1", r); err != nil {
			return err
		}
	}
	for _, sc := range s.Scopes {
		if err := PutScope(ctx, w, sc); err != nil {
			return err
		}
	}
	for _, wr := range s.Wrappers {
		if err := PutWrapper(ctx, w, "sb1", wr); err != nil {
			return err
		}
	}
	if err := PutKeyAllocation(ctx, w, "sb1", s.KeyAllocations["k1"]); err != nil {
		return err
	}
	return PutKeyAllocations(ctx, w, "sb1", []*KeyAllocation{s.KeyAllocations["k2"], s.KeyAllocations["k3"]})
}

// ownSB1 is a new Redis on which replica-a owns sandbox sb1.
func ownSB1(t *testing.T) (context.Context, redis.UniversalClient, *ownership.Owner) {
	t.Helper()
	rdb := redistest.Universal(t)
	owner, err := ownership.Acquire(t.Context(), rdb, "sb1", ownership.Holder{Replica: "replica-a"}, time.Minute)
	require.NoError(t, err)
	return t.Context(), rdb, owner
}

func TestKeysShareTheOwnerLeaseSlot(t *testing.T) {
	require.Equal(t, "sbx:{sbx/sb1}:routes", Key("sb1", "routes"))
	require.Equal(t, "sbx/sb1", fence.HashTag(Key("sb1", "routes")), "guarded by the owner lease of sb1")
}

func TestPutThenLoad(t *testing.T) {
	ctx, rdb, owner := ownSB1(t)

	empty, err := Load(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, Snapshot{Routes: map[string]*Route{}, Scopes: map[string]*scope.Scope{},
		Wrappers: map[string]*Wrapper{}, KeyAllocations: map[string]*KeyAllocation{}}, empty)
	alloc, err := AllocationID(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Empty(t, alloc)

	want := sandboxState()
	require.NoError(t, put(ctx, owner, want))
	require.NoError(t, PutKeyAllocations(ctx, owner, "sb1", nil), "no slots is no write")
	got, err := Load(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, want, got)
	alloc, err = AllocationID(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, "alloc-1", alloc)

	// A write replaces the record of the same session; DeleteRoute removes one.
	failed := routeRecord("s2", RouteFailed)
	failed.FailureReason, failed.Retryable = "clone failed", true
	require.NoError(t, PutRoute(ctx, owner, "sb1", failed))
	require.NoError(t, DeleteRoute(ctx, owner, rdb, "sb1", "s1"))
	require.NoError(t, DeleteRoute(ctx, owner, rdb, "sb1", "never-routed"))
	got, err = Load(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, map[string]*Route{"s2": failed}, got.Routes)
}

func TestStaleOwnerChangesNothing(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Universal(t)
	old, err := ownership.Acquire(ctx, rdb, "sb1", ownership.Holder{Replica: "replica-a"}, time.Minute)
	require.NoError(t, err)
	require.NoError(t, put(ctx, old, sandboxState()))

	// old's lease expires and replica b takes sb1 over.
	require.NoError(t, rdb.Del(ctx, fence.LeaseKey(ownership.Resource("sb1"))).Err())
	_, err = ownership.Acquire(ctx, rdb, "sb1", ownership.Holder{Replica: "replica-b"}, time.Minute)
	require.NoError(t, err)

	changed := sandboxState()
	changed.AllocationID = "alloc-2"
	changed.Routes["s1"].State = RouteReleased
	changed.Scopes["/src/app"].Members = nil
	changed.Wrappers["w1"].Generation = 3
	changed.KeyAllocations["k1"].Alloc.Phase = allocation.Stopping
	changed.KeyAllocations["k2"].Alloc.Phase = allocation.Stopping
	for name, write := range map[string]func() error{
		"meta":    func() error { return PutMeta(ctx, old, "sb1", changed.AllocationID) },
		"route":   func() error { return PutRoute(ctx, old, "sb1", changed.Routes["s1"]) },
		"scope":   func() error { return PutScope(ctx, old, changed.Scopes["/src/app"]) },
		"wrapper": func() error { return PutWrapper(ctx, old, "sb1", changed.Wrappers["w1"]) },
		"slot":    func() error { return PutKeyAllocation(ctx, old, "sb1", changed.KeyAllocations["k1"]) },
		"slots": func() error {
			return PutKeyAllocations(ctx, old, "sb1", []*KeyAllocation{changed.KeyAllocations["k2"]})
		},
		"delete": func() error { return DeleteRoute(ctx, old, rdb, "sb1", "s1") },
		"egress window": func() error {
			return PutEgressWindow(ctx, old, "sb1", EgressWindow{Start: now, Used: 1}, time.Now().Add(time.Hour))
		},
	} {
		err := write()
		require.ErrorIs(t, err, fence.ErrStaleToken, name)
		require.True(t, ownership.IsStale(err), name)
	}

	got, err := Load(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, sandboxState(), got)
}

// The egress byte window outlives its owner until the window ends: a new
// owner reads what the last one saved; an ended window is not written, and
// one that does not parse is an error, not a fresh window.
func TestEgressWindowOutlivesItsOwnerUntilItEnds(t *testing.T) {
	ctx, rdb, owner := ownSB1(t)
	none, err := LoadEgressWindow(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Zero(t, none)

	start := time.UnixMilli(time.Now().UnixMilli()).UTC()
	saved := EgressWindow{Start: start, Used: 5 << 20}
	require.NoError(t, PutEgressWindow(ctx, owner, "sb1", saved, time.Now().Add(time.Hour)))
	got, err := LoadEgressWindow(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.True(t, saved.Start.Equal(got.Start), "%v, %v", saved.Start, got.Start)
	require.Equal(t, saved.Used, got.Used)
	ttl, err := rdb.PTTL(ctx, Key("sb1", "egress")).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 59*time.Minute, "kept until the window ends")
	require.LessOrEqual(t, ttl, time.Hour)

	require.NoError(t, rdb.Del(ctx, Key("sb1", "egress")).Err())
	require.NoError(t, PutEgressWindow(ctx, owner, "sb1", saved, time.Now().Add(-time.Second)))
	n, err := rdb.Exists(ctx, Key("sb1", "egress")).Result()
	require.NoError(t, err)
	require.Zero(t, n, "an ended window is not written")

	require.NoError(t, rdb.Set(ctx, Key("sb1", "egress"), "{not json", time.Minute).Err())
	_, err = LoadEgressWindow(ctx, rdb, "sb1")
	require.Error(t, err)
}

func TestLoadSkipsRecordsThatDoNotParse(t *testing.T) {
	// Documented: such a route is prepared again and such a wrapper is
	// stopped by its lease; the records that parse still load.
	ctx, rdb, owner := ownSB1(t)
	want := sandboxState()
	require.NoError(t, put(ctx, owner, want))

	for _, kind := range []string{"routes", "scopes", "wrappers", "slots"} {
		require.NoError(t, rdb.HSet(ctx, Key("sb1", kind), "torn", `{"state":`, "wrong-shape", `["a list"]`).Err())
	}
	got, err := Load(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"routes/torn", "routes/wrong-shape", "scopes/torn", "scopes/wrong-shape",
		"wrappers/torn", "wrappers/wrong-shape", "slots/torn", "slots/wrong-shape"}, got.Unparsable)
	got.Unparsable = nil
	require.Equal(t, want, got)
}

func TestLoadReturnsReadErrors(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Universal(t)

	require.NoError(t, rdb.Set(ctx, Key("sb1", "meta"), "not a hash", 0).Err())
	_, err := Load(ctx, rdb, "sb1")
	require.ErrorContains(t, err, "WRONGTYPE")
	_, err = AllocationID(ctx, rdb, "sb1")
	require.ErrorContains(t, err, "WRONGTYPE")

	require.NoError(t, rdb.Set(ctx, Key("sb2", "slots"), "not a hash", 0).Err())
	_, err = Load(ctx, rdb, "sb2")
	require.ErrorContains(t, err, "WRONGTYPE")
}

func TestIndexed(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Universal(t)

	ids, err := Indexed(ctx, rdb)
	require.NoError(t, err)
	require.Empty(t, ids)

	for _, id := range []string{"sb1", "sb2", "sb1"} {
		require.NoError(t, Index(ctx, rdb, id))
	}
	ids, err = Indexed(ctx, rdb)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"sb1", "sb2"}, ids)
}

// The route record embeds route.Route: its JSON keys are the ones the
// record had before, so records written by an older replica still load.
func TestRouteRecordKeepsItsJSONKeys(t *testing.T) {
	r := routeRecord("s1", RouteReleased)
	r.Step, r.FailureReason, r.Retryable, r.MemberReleasePending = "prepare_route", "x", true, true
	r.RepoRef, r.RepoDepth, r.GitCredentialRef, r.EgressVersion = "main", 1, "g", 2
	r.Agent = Agent{Profile: "p"}
	r.Egress.PrivateNetworks = []string{"10.0.0.0/8"}
	b, err := json.Marshal(r)
	require.NoError(t, err)
	var keys map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(b, &keys))
	want := []string{"session_id", "directory", "repo_url", "repo_ref", "repo_depth", "git_credential_ref", "user_id", "org_id",
		"credential_ref", "credential_class", "state", "step", "failure_reason", "retryable", "runtime_session_id", "runtime_key",
		"contract", "wrapper_instance", "member_release_pending", "agent", "egress", "egress_version", "updated"}
	require.ElementsMatch(t, want, slices.Collect(maps.Keys(keys)))
	var back Route
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, *r, back)
}
