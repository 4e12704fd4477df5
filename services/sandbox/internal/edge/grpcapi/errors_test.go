package grpcapi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/logging"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/sandbox/internal/control/driver"
)

// Issue 18 item 6: a real Redis outage is UNAVAILABLE STORE_UNAVAILABLE with
// RetryInfo; an unknown error is INTERNAL (logged, text withheld), not a
// store outage; a cancelled call stays CANCELED.
func TestToStatusTellsStoreOutageFromInternalErrors(t *testing.T) {
	var logs logtest.Buffer
	log := logging.New(&logs, logging.Text, slog.LevelDebug)
	ctx := context.Background()

	srv := redistest.Start(t)
	rdb := srv.Client(t)
	require.NoError(t, srv.Kill())
	outage := rdb.Get(ctx, "sbx:index").Err()
	require.Error(t, outage)
	got := toStatus(ctx, log, fmt.Errorf("store: load: %w", outage))
	require.Equal(t, codes.Unavailable, status.Code(got), "%v", got)
	require.Equal(t, apierr.ReasonStoreUnavailable, apierr.Reason(got))
	_, ok := apierr.RetryDelay(got)
	require.True(t, ok, "RetryInfo")

	got = toStatus(ctx, log, errors.New("provider: launch: exec format error at /srv/x"))
	require.Equal(t, codes.Internal, status.Code(got))
	require.Equal(t, apierr.ReasonInternal, apierr.Reason(got))
	require.NotContains(t, got.Error(), "/srv/x")
	require.Contains(t, logs.String(), "/srv/x")

	require.Equal(t, codes.Canceled, status.Code(toStatus(ctx, log, context.Canceled)))
	require.Equal(t, codes.DeadlineExceeded, status.Code(toStatus(ctx, log, context.DeadlineExceeded)))
	require.Equal(t, codes.NotFound, status.Code(toStatus(ctx, log, driver.ErrRouteNotFound)))
	require.NoError(t, toStatus(ctx, log, nil))
	srv.Start(t)
}
