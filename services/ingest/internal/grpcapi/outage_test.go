package grpcapi_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
)

// Issue 18 item 6: while Redis is down every call answers UNAVAILABLE
// STORE_UNAVAILABLE with RetryInfo, not INTERNAL.
func TestStoreOutageIsUnavailable(t *testing.T) {
	h := start(t)
	ctx := context.Background()
	_, err := h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{
		RuntimeSessionId: "rs-1", SessionId: "ses-1", SandboxId: "sbx", Directory: "/w"}})
	require.NoError(t, err)
	require.NoError(t, h.redis.Kill())
	_, err = h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs-1"})
	requireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	d, ok := apierr.RetryDelay(err)
	require.True(t, ok, "RetryInfo")
	require.Positive(t, d)
	_, err = h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("a", 1)}})
	requireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	h.redis.Start(t)
}
