package tenancy

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/sandbox/internal/control/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(redistest.Shared(m)) }

var (
	alice   = Tenant{Org: "orgA", User: "alice"}
	mallory = Tenant{Org: "orgEvil", User: "mallory"}
)

func TestDecide(t *testing.T) {
	for _, tt := range []struct {
		name     string
		recorded string
		caller   Tenant
		ok       bool
	}{
		{"own", alice.encode(), alice, true},
		{"another tenant", alice.encode(), mallory, false},
		{"same user, another org", alice.encode(), Tenant{Org: "orgB", User: "alice"}, false},
		{"same org, another user", alice.encode(), Tenant{Org: "orgA", User: "bob"}, false},
		{"unbound", "", alice, false},
		{"unparsable record", "{", alice, false},
		{"empty tenant recorded", Tenant{}.encode(), Tenant{}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := Decide(tt.recorded, tt.caller)
			if tt.ok {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, ErrMismatch)
			}
		})
	}
}

func TestInherited(t *testing.T) {
	_, ok := Inherited(nil)
	require.False(t, ok, "no routes: nobody")
	got, ok := Inherited([][2]string{{"orgA", "alice"}, {"orgA", "alice"}})
	require.True(t, ok)
	require.Equal(t, alice, got)
	_, ok = Inherited([][2]string{{"orgA", "alice"}, {"orgEvil", "mallory"}})
	require.False(t, ok, "a sandbox two tenants shared names no one")
}

// The first creating call binds; later calls only compare, and a call
// that does not create binds nothing.
func TestClaimAndCheck(t *testing.T) {
	ctx := context.Background()
	b := Binder{Redis: redistest.Universal(t)}

	require.ErrorIs(t, b.Check(ctx, "sb-new", alice), ErrMismatch, "an unbound sandbox is nobody's")
	require.ErrorIs(t, b.Check(ctx, "sb-new", mallory), ErrMismatch)
	require.NoError(t, b.Claim(ctx, "sb-new", alice), "the check bound nothing")
	require.NoError(t, b.Check(ctx, "sb-new", alice))
	require.NoError(t, b.Claim(ctx, "sb-new", alice), "claiming again is a check")
	require.ErrorIs(t, b.Claim(ctx, "sb-new", mallory), ErrMismatch)
	require.ErrorIs(t, b.Check(ctx, "sb-new", mallory), ErrMismatch)
	require.NoError(t, b.Check(ctx, "sb-new", alice), "a refused claim changed nothing")
}

// Two tenants racing to claim each of many sandboxes: exactly one wins
// each, and the loser is refused from then on.
func TestRacingClaimsOneWins(t *testing.T) {
	ctx := context.Background()
	b := Binder{Redis: redistest.Universal(t)}
	for i := range 50 {
		id := fmt.Sprintf("sb-race-%d", i)
		var wg sync.WaitGroup
		errs := map[Tenant]error{}
		var mu sync.Mutex
		for _, tn := range []Tenant{alice, mallory} {
			wg.Go(func() {
				err := b.Claim(ctx, id, tn)
				mu.Lock()
				errs[tn] = err
				mu.Unlock()
			})
		}
		wg.Wait()
		require.NotEqual(t, errs[alice] == nil, errs[mallory] == nil, "exactly one wins %s: %v", id, errs)
		winner, loser := alice, mallory
		if errs[alice] != nil {
			winner, loser = mallory, alice
		}
		require.ErrorIs(t, errs[loser], ErrMismatch)
		require.NoError(t, b.Check(ctx, id, winner))
		require.ErrorIs(t, b.Check(ctx, id, loser), ErrMismatch)
	}
}

// A sandbox stored before tenancy is bound to the one tenant its routes
// name, whoever names it first; one two tenants shared is bound by the
// next creating call.
func TestSandboxesStoredBeforeTenancy(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Universal(t)
	b := Binder{Redis: rdb}
	route := func(sb, session string, tn Tenant) {
		require.NoError(t, rdb.HSet(ctx, store.Key(sb, "routes"), session,
			fmt.Sprintf(`{"session_id":%q,"org_id":%q,"user_id":%q,"state":"ready"}`, session, tn.Org, tn.User)).Err())
	}
	route("sb-old", "s1", alice)
	route("sb-old", "s2", alice)
	require.ErrorIs(t, b.Claim(ctx, "sb-old", mallory), ErrMismatch, "mallory names it first: still alice's")
	require.NoError(t, b.Check(ctx, "sb-old", alice))
	rec, err := store.LoadTenant(ctx, rdb, "sb-old")
	require.NoError(t, err)
	require.JSONEq(t, `{"org":"orgA","user":"alice"}`, rec)

	route("sb-shared", "s1", alice)
	route("sb-shared", "s2", mallory)
	require.ErrorIs(t, b.Check(ctx, "sb-shared", alice), ErrMismatch, "a shared one is nobody's until claimed")
	require.NoError(t, b.Claim(ctx, "sb-shared", alice))
	require.ErrorIs(t, b.Check(ctx, "sb-shared", mallory), ErrMismatch)
}
