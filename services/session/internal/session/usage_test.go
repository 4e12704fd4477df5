package session

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Usage adds to the totals and to the next outcome, which takes it once;
// a repeated outcome takes nothing; a deleting session counts nothing.
func TestUsageGoesToTheNextOutcome(t *testing.T) {
	a := agg()
	a.Seen = map[string]bool{}
	a.AddUsage(Usage{Input: 10, Output: 2, Cached: 1, Requests: 1, Model: "m1"})
	a.AddUsage(Usage{Input: 5, Output: 1, Requests: 1})
	require.True(t, a.SessionChanged())
	var got []Usage
	with := func(u Usage) []byte { got = append(got, u); return []byte("with") }
	a.Outcome("t1", "", TurnSucceeded, "", []byte("p"), with, t0)
	require.Equal(t, []Usage{{Input: 15, Output: 3, Cached: 1, Requests: 2, Model: "m1"}}, got)
	require.Equal(t, []byte("with"), a.Events()[len(a.Events())-1].Payload)
	require.Zero(t, a.Session.TurnUsage)

	a.Seen["t1"] = true
	a.AddUsage(Usage{Input: 1, Requests: 1})
	a.Outcome("t1", "", TurnSucceeded, "", []byte("p"), with, t0) // a repeat: takes nothing
	require.Len(t, got, 1)
	a.Outcome("t2", "", TurnSucceeded, "", []byte("p"), with, t0)
	require.Equal(t, Usage{Input: 1, Requests: 1}, got[1])
	a.Outcome("t3", "", TurnSucceeded, "", []byte("p"), with, t0) // nothing since: the payload as it is
	require.Len(t, got, 2)
	require.Equal(t, []byte("p"), a.Events()[len(a.Events())-1].Payload)
	require.Equal(t, Usage{Input: 16, Output: 3, Cached: 1, Requests: 3, Model: "m1"}, a.Session.Usage)

	a.Session.State = StateDeleting
	a.AddUsage(Usage{Input: 100, Requests: 1})
	require.Equal(t, uint64(16), a.Session.Usage.Input)
}

func TestPriceTable(t *testing.T) {
	tab, err := ParsePriceTable(`{"m":{"input":3,"output":15,"cached":0.3}}`)
	require.NoError(t, err)
	c, ok := tab.Cost(Usage{Input: 2_000_000, Cached: 1_000_000, Output: 100_000, Model: "m"})
	require.True(t, ok)
	require.InDelta(t, 3+0.3+1.5, c, 1e-9)
	_, ok = tab.Cost(Usage{Input: 1, Model: "other"})
	require.False(t, ok, "no \"*\" entry: unpriced")
	none, err := ParsePriceTable(" ")
	require.NoError(t, err)
	_, ok = none.Cost(Usage{Input: 1, Model: "m"})
	require.False(t, ok)
}
