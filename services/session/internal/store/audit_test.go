package store

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/session/internal/session"
)

func proxyRecord(turn string, i int) session.AuditRecord {
	return session.AuditRecord{TurnID: turn, Kind: session.AuditKindProxy, Time: time.Unix(int64(1000+i), 0).UTC(),
		Proxy: &session.AuditProxy{Route: "provider", Method: "POST", PathTemplate: "v1/chat/completions", Status: 200, BytesIn: uint64(i)}}
}

func expectedDenial(turn, host string) session.AuditRecord {
	return session.AuditRecord{TurnID: turn, Kind: session.AuditKindEgress, Time: time.Unix(2000, 0).UTC(),
		Egress: &session.AuditEgress{Host: host, Port: 443, Decision: session.EgressDenied, Reason: "not_allowed", Expected: true}}
}

func newAuditStore(t *testing.T, ids ...string) (*Store, context.Context) {
	t.Helper()
	rs := redistest.Start(t)
	s := New(rs.Client(t), 1000, noDeadline)
	ctx := context.Background()
	for _, id := range ids {
		_, _, err := s.Create(ctx, &session.Session{ID: id, OrgID: "o", UserID: "u", SandboxID: "sbx", Directory: "/w", CreateTime: time.Unix(1, 0)},
			func(*session.Session) error { return nil })
		require.NoError(t, err)
	}
	return s, ctx
}

// TestAuditPagesInOrder: records list oldest first over pages of the size
// asked, each page's token continuing exactly after it, and a session's
// records are its own.
func TestAuditPagesInOrder(t *testing.T) {
	s, ctx := newAuditStore(t, "a", "b")
	var recs []session.AuditRecord
	for i := range 7 {
		recs = append(recs, proxyRecord(fmt.Sprintf("m%d", i%2), i))
	}
	n, err := s.AppendAudit(ctx, "a", recs)
	require.NoError(t, err)
	require.Equal(t, 7, n)
	_, err = s.AppendAudit(ctx, "b", []session.AuditRecord{proxyRecord("x", 99)})
	require.NoError(t, err)

	var got []uint64
	var pages []int
	cursor := ""
	for {
		page, next, err := s.ListAudit(ctx, "a", cursor, "", 3)
		require.NoError(t, err)
		pages = append(pages, len(page))
		for _, r := range page {
			require.True(t, ValidAuditCursor(r.ID), r.ID)
			got = append(got, r.Proxy.BytesIn)
		}
		if next == "" {
			break
		}
		require.True(t, ValidAuditCursor(next))
		cursor = next
	}
	require.Equal(t, []uint64{0, 1, 2, 3, 4, 5, 6}, got)
	require.Equal(t, []int{3, 3, 1}, pages)

	// Exactly a page: no token, no empty page after it.
	page, next, err := s.ListAudit(ctx, "a", "", "", 7)
	require.NoError(t, err)
	require.Len(t, page, 7)
	require.Empty(t, next)

	// Filtered by turn.
	page, next, err = s.ListAudit(ctx, "a", "", "m1", 10)
	require.NoError(t, err)
	require.Empty(t, next)
	require.Len(t, page, 3)
	for _, r := range page {
		require.Equal(t, "m1", r.TurnID)
	}

	page, _, err = s.ListAudit(ctx, "b", "", "", 10)
	require.NoError(t, err)
	require.Len(t, page, 1)
	require.Equal(t, "x", page[0].TurnID)
}

// TestAuditCountsExpectedDenials: an expected denial is stored once per
// turn, host and port and counted; an unexpected one is a record each.
func TestAuditCountsExpectedDenials(t *testing.T) {
	s, ctx := newAuditStore(t, "a")
	unexpected := expectedDenial("m1", "evil.example")
	unexpected.Egress.Expected = false
	batch := []session.AuditRecord{expectedDenial("m1", "us.i.posthog.com"), expectedDenial("m1", "us.i.posthog.com"), unexpected, unexpected}
	n, err := s.AppendAudit(ctx, "a", batch)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	n, err = s.AppendAudit(ctx, "a", []session.AuditRecord{expectedDenial("m1", "us.i.posthog.com"), expectedDenial("m2", "us.i.posthog.com")})
	require.NoError(t, err)
	require.Equal(t, 1, n, "m1's is counted, m2's is new")

	page, _, err := s.ListAudit(ctx, "a", "", "", 10)
	require.NoError(t, err)
	require.Len(t, page, 4)
	require.Equal(t, "us.i.posthog.com", page[0].Egress.Host)
	require.EqualValues(t, 3, page[0].Egress.Count)
	require.EqualValues(t, 1, page[1].Egress.Count)
	require.EqualValues(t, 1, page[2].Egress.Count)
	require.Equal(t, "m2", page[3].TurnID)
	require.EqualValues(t, 1, page[3].Egress.Count)
}

// TestAuditOnlyForLiveSessions: a missing or deleting session takes no
// records, and the wipe removes them with the session's other keys.
func TestAuditOnlyForLiveSessions(t *testing.T) {
	s, ctx := newAuditStore(t, "a")
	_, err := s.AppendAudit(ctx, "nope", []session.AuditRecord{proxyRecord("m", 1)})
	require.ErrorIs(t, err, session.ErrSessionNotFound)

	_, err = s.AppendAudit(ctx, "a", []session.AuditRecord{proxyRecord("m", 1), expectedDenial("m", "h")})
	require.NoError(t, err)
	sess, err := s.Get(ctx, "a")
	require.NoError(t, err)
	in := session.NewDeletionIntent(sess, "client", time.Unix(5, 0))
	lease, err := s.DeletionLease(ctx, "a", "test", time.Minute)
	require.NoError(t, err)
	require.NoError(t, s.SaveIntent(ctx, lease, &in))
	_, err = s.AppendAudit(ctx, "a", []session.AuditRecord{proxyRecord("m", 2)})
	require.ErrorIs(t, err, session.ErrSessionNotFound, "a deleting session takes no records")

	require.NoError(t, s.Wipe(ctx, lease, &in, WipeLocator{SandboxID: "sbx", Directory: "/w"}, 0))
	keys, err := s.rdb.Keys(ctx, "ses:{ses/a}:*").Result()
	require.NoError(t, err)
	require.Empty(t, keys)
}

func TestValidAuditCursor(t *testing.T) {
	for c, ok := range map[string]bool{"1-0": true, "1700000000000-12": true, "": false, "1": false, "a-1": false, "1-2-3": false, "-1-2": false} {
		require.Equal(t, ok, ValidAuditCursor(c), c)
	}
}
