package egress

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Issue 33 item 10: a budget just made by one connection was swept as idle
// by the next connection's lookup before the first counted itself open on
// it (its window not started yet reads as ended): two budgets for one
// sandbox, each granting the whole allowance. Here the second lookup comes
// right after the first, the interleaving that split it; and under -race
// many connections at once all land on one budget.
func TestEgressBudgetIsNotSplitByAConcurrentLookup(t *testing.T) {
	p := New(Config{Limits: Limits{MaxBytes: 1000, BytesWindow: time.Hour}})
	g := Grant{Key: "sbx-1", Owner: 7}
	first, err := p.budget(g)
	require.NoError(t, err)
	second, err := p.budget(g)
	require.NoError(t, err)
	require.Same(t, first, second, "the second connection found the first one's budget")

	p2 := New(Config{Limits: Limits{MaxBytes: 1000, BytesWindow: time.Hour}})
	var wg sync.WaitGroup
	got := make([]*budget, 32)
	for i := range got {
		wg.Go(func() {
			b, reason := p2.acquire(g)
			require.Empty(t, reason)
			got[i] = b
		})
	}
	wg.Wait()
	for _, b := range got {
		require.Same(t, got[0], b)
	}
	got[0].mu.Lock()
	defer got[0].mu.Unlock()
	require.Equal(t, len(got), got[0].open)
}
