package store

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/session/internal/session"
)

// A kept state is dropped once its session has not changed for recentIdle,
// whether it is asked for again or not (a session deleted through another
// replica is never asked for): the kept states follow the sessions changed
// lately, not every session ever served.
func TestKeptStatesExpireWhenIdle(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	r := newRecentStates()
	r.now = func() time.Time { return now }
	keep := func(id string) {
		r.remember(&session.Aggregate{Session: session.Session{ID: id}}, stored{meta: "m"})
	}
	for i := range 100 {
		keep(fmt.Sprint("old", i))
	}
	require.NotNil(t, r.get("old0"))

	now = now.Add(recentIdle - time.Second)
	require.NotNil(t, r.get("old1"), "kept while younger than recentIdle")
	now = now.Add(time.Second)
	require.Nil(t, r.get("old1"), "dropped once idle for recentIdle")

	keep("new") // a sweep drops the idle states nobody asked for
	require.Equal(t, 1, r.m.Len())
	require.NotNil(t, r.get("new"))
}
