package paging

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCheck(t *testing.T) {
	for _, ok := range []int32{0, 1, 50, MaxPageSize} {
		require.Empty(t, Check(ok), ok)
	}
	for _, bad := range []int32{-1, math.MinInt32, MaxPageSize + 1, math.MaxInt32} {
		require.Equal(t, "must be 0 (the default) to 500", Check(bad), bad)
	}
}
