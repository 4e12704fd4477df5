package testclock

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestAddMovesNow(t *testing.T) {
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	c := New(start)
	require.Equal(t, start, c.Now())
	c.Add(90 * time.Second)
	require.Equal(t, start.Add(90*time.Second), c.Now())
}
