package scope

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/credential/internal/handle"
)

var (
	t0     = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	policy = Policy{GrantTTL: 4 * time.Hour, ReissueBelow: time.Hour, OverlapWindow: 5 * time.Minute}
	sc     = Scope{SandboxID: "sb1", Directory: "/w/repo"}
)

func member(n int) Member {
	return Member{SessionID: fmt.Sprintf("s%d", n), RuntimeSessionID: fmt.Sprintf("rs%d", n), UserID: "u", CredentialRef: fmt.Sprintf("cr%d", n)}
}

func cand() Candidate {
	raw, _ := handle.New(handle.Worktree)
	return Candidate{Digest: handle.DigestOf(raw).String(), Sealed: []byte("sealed")}
}

func join(n int, fence uint64) Join {
	return Join{Member: member(n), Class: Static, Contract: Worktree, Fence: fence, AllocationID: "a1"}
}

func digestOf(t *testing.T, e Entry) handle.Digest {
	d, err := handle.ParseDigest(e.Digest)
	require.NoError(t, err)
	return d
}

func TestMintIsIdempotentPerFenceAndAdoptSharesHandle(t *testing.T) {
	st := &State{Scope: sc}
	first, err := st.Mint(join(1, 10), cand(), t0, policy)
	require.NoError(t, err)
	require.True(t, first.Minted)

	again, err := st.Mint(join(1, 10), cand(), t0.Add(time.Minute), policy)
	require.NoError(t, err)
	require.True(t, again.Adopted)
	require.Equal(t, first.Entry.Digest, again.Entry.Digest)

	sib, err := st.Adopt(join(2, 10), t0.Add(time.Minute), policy)
	require.NoError(t, err)
	require.Equal(t, first.Entry.Digest, sib.Entry.Digest)

	sib2, err := st.Mint(join(3, 10), cand(), t0.Add(time.Minute), policy)
	require.NoError(t, err)
	require.Equal(t, first.Entry.Digest, sib2.Entry.Digest, "a sibling minting under the same fence gets the canonical handle")
	require.Len(t, st.Members, 3)
	require.Equal(t, 1, st.LiveWorktreeEntries(t0))
}

func TestConflictLeavesGrantUnchanged(t *testing.T) {
	st := &State{Scope: sc}
	_, err := st.Mint(join(1, 10), cand(), t0, policy)
	require.NoError(t, err)
	before := fmt.Sprintf("%+v", *st)

	_, err = st.Adopt(join(2, 11), t0, policy)
	require.ErrorIs(t, err, ErrHandleConflict)
	_, err = st.Mint(join(2, 11), cand(), t0, policy)
	require.ErrorIs(t, err, ErrHandleConflict)
	require.Equal(t, before, fmt.Sprintf("%+v", *st))
}

func TestClassMixed(t *testing.T) {
	st := &State{Scope: sc}
	_, err := st.Mint(join(1, 10), cand(), t0, policy)
	require.NoError(t, err)
	j := join(2, 10)
	j.Class = Delegated
	_, err = st.Adopt(j, t0, policy)
	require.ErrorIs(t, err, ErrClassMixed)
	_, err = st.Mint(j, cand(), t0, policy)
	require.ErrorIs(t, err, ErrClassMixed)
	require.Len(t, st.Members, 1)
}

// A scope's handle serves one tenant: a member of another org, or another
// user of the same org, neither mints nor adopts, and nothing changes.
func TestTenantMismatch(t *testing.T) {
	st := &State{Scope: sc}
	_, err := st.Mint(join(1, 10), cand(), t0, policy)
	require.NoError(t, err)
	before := fmt.Sprintf("%+v", *st)
	for _, other := range []struct{ org, user string }{{"evil", "u"}, {"", "mallory"}} {
		j := join(2, 10)
		j.Member.OrgID, j.Member.UserID = other.org, other.user
		_, err = st.Adopt(j, t0, policy)
		require.ErrorIs(t, err, ErrTenantMismatch)
		_, err = st.Mint(j, cand(), t0, policy)
		require.ErrorIs(t, err, ErrTenantMismatch)
	}
	require.Equal(t, before, fmt.Sprintf("%+v", *st))
	_, err = st.Adopt(join(2, 10), t0, policy)
	require.NoError(t, err, "the same tenant still joins")
}

func TestContractDowngradeRefusedPerSessionKeepsWorking(t *testing.T) {
	st := &State{Scope: sc}
	ps := join(1, 10)
	ps.Contract = PerSession
	r1, err := st.Mint(ps, cand(), t0, policy)
	require.NoError(t, err)
	require.Equal(t, handle.PerSession, r1.Entry.Kind)

	_, err = st.Mint(join(2, 10), cand(), t0, policy) // the worktree contract pins
	require.NoError(t, err)
	require.Equal(t, Worktree, st.Contract)

	ps3 := join(3, 10)
	ps3.Contract = PerSession
	_, err = st.Mint(ps3, cand(), t0, policy)
	require.ErrorIs(t, err, ErrContractDowngrade)

	res, err := st.Resolve(digestOf(t, r1.Entry), "sb1", t0)
	require.NoError(t, err, "per-session handles keep working on their path")
	require.Equal(t, "s1", res.Member.SessionID)
}

func TestRotateOverlap(t *testing.T) {
	st := &State{Scope: sc}
	r, err := st.Mint(join(1, 10), cand(), t0, policy)
	require.NoError(t, err)
	_, err = st.Adopt(join(2, 10), t0, policy)
	require.NoError(t, err)

	e, until, err := st.Rotate(10, cand(), t0, policy)
	require.NoError(t, err)
	require.Equal(t, t0.Add(policy.OverlapWindow), until)
	for _, s := range []string{"s1", "s2"} {
		m, _ := st.MemberBySession(s)
		require.Equal(t, s, m.SessionID)
	}
	_, err = st.Resolve(digestOf(t, r.Entry), "sb1", until.Add(-time.Nanosecond))
	require.NoError(t, err, "old handle works during the overlap")
	_, err = st.Resolve(digestOf(t, r.Entry), "sb1", until)
	require.ErrorIs(t, err, ErrUnknownHandle)
	_, err = st.Resolve(digestOf(t, e), "sb1", until)
	require.NoError(t, err)

	// A joiner gets the new handle.
	j, err := st.Adopt(join(3, 10), t0, policy)
	require.NoError(t, err)
	require.Equal(t, e.Digest, j.Entry.Digest)
}

func TestCapEvictsOldestNonCurrent(t *testing.T) {
	st := &State{Scope: sc}
	_, err := st.Mint(join(1, 10), cand(), t0, policy)
	require.NoError(t, err)
	var digests []string
	for i := range 10 {
		e, _, err := st.Rotate(10, cand(), t0.Add(time.Duration(i)*time.Second), policy)
		require.NoError(t, err)
		digests = append(digests, e.Digest)
		require.LessOrEqual(t, st.LiveWorktreeEntries(t0), MaxAccepted)
	}
	require.Equal(t, MaxAccepted, st.LiveWorktreeEntries(t0))
	cur := st.Entries[st.currentWorktree()]
	require.Equal(t, digests[len(digests)-1], cur.Digest, "the current handle is never evicted")
	var kept []string
	for _, e := range st.Entries {
		kept = append(kept, e.Digest)
	}
	require.Equal(t, digests[len(digests)-MaxAccepted:], kept, "the oldest went first")
}

func TestRetireAndRelease(t *testing.T) {
	for _, lastMember := range []bool{false, true} {
		st := &State{Scope: sc}
		_, _ = st.Mint(join(1, 10), cand(), t0, policy)
		_, _, _ = st.Rotate(10, cand(), t0, policy)
		require.Equal(t, 2, st.Retire(lastMember))
		require.Empty(t, st.Entries)
		require.Equal(t, lastMember, len(st.Members) == 0)
	}

	st := &State{Scope: sc}
	_, _ = st.Mint(join(1, 10), cand(), t0, policy)
	_, _ = st.Adopt(join(2, 10), t0, policy)
	retired, left := st.Release("s1")
	require.False(t, retired)
	require.Equal(t, 1, left)
	require.Len(t, st.Entries, 1)
	retired, left = st.Release("s2")
	require.True(t, retired)
	require.Zero(t, left)
	require.True(t, st.Empty())
}

func TestAllocationChangeRetires(t *testing.T) {
	st := &State{Scope: sc}
	r1, _ := st.Mint(join(1, 10), cand(), t0, policy)
	j := join(1, 10)
	j.AllocationID = "a2"
	r2, err := st.Mint(j, cand(), t0, policy)
	require.NoError(t, err)
	require.True(t, r2.Minted)
	require.NotEqual(t, r1.Entry.Digest, r2.Entry.Digest)
	require.Len(t, st.Entries, 1)
}

func TestResolveThroughLiveMember(t *testing.T) {
	st := &State{Scope: sc}
	r, _ := st.Mint(join(1, 10), cand(), t0, policy)
	_, _ = st.Adopt(join(2, 10), t0, policy)
	_, _ = st.Adopt(join(3, 10), t0, policy)
	d := digestOf(t, r.Entry)

	res, err := st.Resolve(d, "sb1", t0)
	require.NoError(t, err)
	require.Equal(t, "s1", res.Member.SessionID, "the issuer while it lives")

	_, err = st.Resolve(d, "sb2", t0)
	require.ErrorIs(t, err, ErrSandboxMismatch)

	st.Release("s1") // the issuer was deleted
	res, err = st.Resolve(d, "sb1", t0)
	require.NoError(t, err)
	require.Equal(t, "s2", res.Member.SessionID)
	st.Release("s2")
	res, err = st.Resolve(d, "sb1", t0)
	require.NoError(t, err)
	require.Equal(t, "s3", res.Member.SessionID)
	st.Release("s3")
	_, err = st.Resolve(d, "sb1", t0)
	require.ErrorIs(t, err, ErrUnknownHandle, "refused once no member is live")

	_, err = st.Resolve(d, "sb1", t0.Add(5*time.Hour))
	require.Error(t, err)
}

func TestGrantReissuedUnderAnHour(t *testing.T) {
	st := &State{Scope: sc}
	r, _ := st.Mint(join(1, 10), cand(), t0, policy)
	require.Equal(t, t0.Add(4*time.Hour), r.Entry.ExpireAt)
	a, _ := st.Adopt(join(2, 10), t0.Add(2*time.Hour), policy)
	require.Equal(t, t0.Add(4*time.Hour), a.Entry.ExpireAt, "more than an hour left: unchanged")
	late := t0.Add(3*time.Hour + time.Minute)
	a, _ = st.Adopt(join(2, 10), late, policy)
	require.Equal(t, late.Add(4*time.Hour), a.Entry.ExpireAt, "re-issued on delivery")
	require.Equal(t, r.Entry.Digest, a.Entry.Digest)
}

// Property: any sequence of operations keeps at most MaxAccepted live
// worktree entries and exactly one current one while any exists.
func TestPropertyCap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		st := &State{Scope: sc}
		now := t0
		for range 50 {
			now = now.Add(time.Duration(rng.IntN(120)) * time.Second)
			switch rng.IntN(5) {
			case 0:
				_, _ = st.Mint(join(rng.IntN(4), 10), cand(), now, policy)
			case 1:
				_, _ = st.Adopt(join(rng.IntN(4), 10), now, policy)
			case 2, 3:
				_, _, _ = st.Rotate(10, cand(), now, policy)
			case 4:
				st.Release(fmt.Sprintf("s%d", rng.IntN(4)))
			}
			require.LessOrEqual(t, st.LiveWorktreeEntries(now), MaxAccepted)
			cur := 0
			for _, e := range st.Entries {
				if e.Kind == handle.Worktree && e.Current() {
					cur++
				}
			}
			require.LessOrEqual(t, cur, 1)
		}
	}
}

// TestNarrows: every operation that removes, changes or shortens something a
// resolution could use narrows; joins, adoptions, idempotent mints and
// reissues only widen (the credential service waits out the proxies'
// resolution caches after a narrowing write, never after a widening one).
func TestNarrows(t *testing.T) {
	base := func() *State {
		st := &State{Scope: sc}
		_, err := st.Mint(join(1, 100), cand(), t0, policy)
		require.NoError(t, err)
		_, err = st.Adopt(join(2, 100), t0, policy)
		require.NoError(t, err)
		return st
	}
	for _, tc := range []struct {
		name    string
		op      func(st *State)
		narrows bool
	}{
		{"same fence mints again", func(st *State) { _, _ = st.Mint(join(1, 100), cand(), t0, policy) }, false},
		{"sibling adopts", func(st *State) { _, _ = st.Adopt(join(4, 100), t0, policy) }, false},
		{"reissue extends the expiry", func(st *State) { _, _ = st.Adopt(join(4, 100), t0.Add(3*time.Hour+time.Minute), policy) }, false},
		{"nothing changes", func(*State) {}, false},
		{"member leaves", func(st *State) { st.Release("s2") }, true},
		{"first member leaves", func(st *State) { st.Release("s1") }, true},
		{"last member leaves", func(st *State) { st.Release("s1"); st.Release("s2") }, true},
		{"retire entries", func(st *State) { st.Retire(false) }, true},
		{"retire all", func(st *State) { st.Retire(true) }, true},
		{"rotation cuts the old handle to the overlap", func(st *State) { _, _, _ = st.Rotate(100, cand(), t0, policy) }, true},
		{"allocation change", func(st *State) {
			j := join(1, 100)
			j.AllocationID = "a2"
			_, _ = st.Mint(j, cand(), t0, policy)
		}, true},
		{"member rejoins with another credential", func(st *State) {
			j := join(2, 100)
			j.Member.CredentialRef = "cr-new"
			_, _ = st.Adopt(j, t0, policy)
		}, true},
		{"expired entry pruned by the next mint", func(st *State) { _, _ = st.Mint(join(1, 100), cand(), t0.Add(5*time.Hour), policy) }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := base()
			after := before.Clone()
			tc.op(after)
			require.Equal(t, tc.narrows, Narrows(before, after))
		})
	}

	// A per-session handle replaced under a newer fence narrows; the
	// session's first mint does not.
	st := &State{Scope: sc}
	ps := join(1, 100)
	ps.Contract = PerSession
	_, err := st.Mint(ps, cand(), t0, policy)
	require.NoError(t, err)
	first := st.Clone()
	_, err = st.Mint(ps, cand(), t0, policy)
	require.NoError(t, err)
	require.False(t, Narrows(first, st))
	ps.Fence = 101
	_, err = st.Mint(ps, cand(), t0, policy)
	require.NoError(t, err)
	require.True(t, Narrows(first, st))
	require.False(t, Narrows(&State{Scope: sc}, first), "a scope's first mint only adds")
}
