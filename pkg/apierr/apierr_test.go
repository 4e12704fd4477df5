package apierr_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
)

func TestRoundTrip(t *testing.T) {
	err := apierr.Error(codes.InvalidArgument, "BATCH_TOO_LARGE", "batch exceeds 4 MiB",
		apierr.FieldViolation("items", "at most 128 items"),
		apierr.FieldViolation("items[3].payload", "at most 2 MiB"),
		apierr.Metadata("limit_bytes", "4194304"),
		apierr.RetryAfter(5*time.Second),
	)

	// Through the wire form, as a client sees it.
	wire := status.FromProto(status.Convert(err).Proto()).Err()

	require.Equal(t, codes.InvalidArgument, status.Code(wire))
	require.Equal(t, "batch exceeds 4 MiB", status.Convert(wire).Message())
	require.Equal(t, "BATCH_TOO_LARGE", apierr.Reason(wire))
	info := apierr.Info(wire)
	require.Equal(t, apierr.Domain, info.GetDomain())
	require.Equal(t, map[string]string{"limit_bytes": "4194304"}, info.GetMetadata())

	fv := apierr.FieldViolations(wire)
	require.Len(t, fv, 2)
	require.Equal(t, "items", fv[0].GetField())
	require.Equal(t, "items[3].payload", fv[1].GetField())

	d, ok := apierr.RetryDelay(wire)
	require.True(t, ok)
	require.Equal(t, 5*time.Second, d)

	// Wrapping keeps the reason readable.
	require.Equal(t, "BATCH_TOO_LARGE", apierr.Reason(fmt.Errorf("calling ingest: %w", wire)))
}

func TestReasonOfOtherErrors(t *testing.T) {
	require.Empty(t, apierr.Reason(nil))
	require.Empty(t, apierr.Reason(fmt.Errorf("plain")))
	require.Empty(t, apierr.Reason(status.Error(codes.Internal, "no details")))
	_, ok := apierr.RetryDelay(apierr.Error(codes.NotFound, "SESSION_NOT_FOUND", "no such session"))
	require.False(t, ok)
	require.Equal(t, codes.OK, apierr.New(codes.OK, "X", "").Code())
}

func TestUnexpectedHidesTextAndKeepsContextCodes(t *testing.T) {
	var logged bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logged, nil))

	err := apierr.Unexpected(context.Background(), log, errors.New("redis: secret detail"))
	st, _ := status.FromError(err)
	require.Equal(t, codes.Internal, st.Code())
	require.NotContains(t, st.Message(), "secret detail")
	require.Equal(t, apierr.ReasonInternal, apierr.Reason(err))
	require.Contains(t, logged.String(), "secret detail", "the text goes to the log only")

	st, _ = status.FromError(apierr.Unexpected(context.Background(), log, fmt.Errorf("x: %w", context.Canceled)))
	require.Equal(t, codes.Canceled, st.Code())
	st, _ = status.FromError(apierr.Unexpected(context.Background(), log, context.DeadlineExceeded))
	require.Equal(t, codes.DeadlineExceeded, st.Code())
}
