package scope

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNegotiate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name            string
		pinned, offered Contract
		want            Contract
		pin             bool
		err             error
	}{
		{"first worktree wrapper pins worktree", Unpinned, Worktree, Worktree, true, nil},
		{"first old wrapper pins per_session", Unpinned, PerSession, PerSession, true, nil},
		{"worktree stays", Worktree, Worktree, Worktree, false, nil},
		{"downgrade rejected", Worktree, PerSession, Worktree, false, ErrContractDowngrade},
		{"per_session stays per_session", PerSession, Worktree, PerSession, false, nil},
		{"per_session with old wrapper", PerSession, PerSession, PerSession, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, pin, err := Negotiate(tc.pinned, tc.offered)
			require.ErrorIs(t, err, tc.err)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.pin, pin)
		})
	}
}

func TestOffered(t *testing.T) {
	t.Parallel()
	require.Equal(t, Worktree, Offered([]string{"worktree"}, 1))
	require.Equal(t, PerSession, Offered([]string{"worktree"}, 0), "stale protocol")
	require.Equal(t, PerSession, Offered(nil, 1), "missing capability")
	require.Equal(t, PerSession, Offered([]string{"worktree2"}, 1), "exact capability only")
}

func TestRuntimeKey(t *testing.T) {
	t.Parallel()
	require.Equal(t, "/w", RuntimeKey(Worktree, "/w", "s1"))
	require.Equal(t, "/w", RuntimeKey(Unpinned, "/w", "s1"))
	require.Equal(t, "s1", RuntimeKey(PerSession, "/w", "s1"))
}

func TestMembers(t *testing.T) {
	t.Parallel()
	s := &Scope{SandboxID: "sb", Directory: "/w"}
	require.NoError(t, s.Admit("a", "static"))
	s.Join("a", "rs-a", "static")
	require.NoError(t, s.Admit("b", "static"))
	require.ErrorIs(t, s.Admit("b", "delegated"), ErrClassMixed)
	s.Join("b", "rs-b", "static")
	require.Equal(t, []string{"a", "b"}, s.SortedMembers())
	require.False(t, s.Leave("a"))
	require.True(t, s.Leave("b"))
}
