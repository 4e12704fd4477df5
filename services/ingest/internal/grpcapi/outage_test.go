package grpcapi_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/apierr/apierrtest"
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
	apierrtest.RequireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	d, ok := apierr.RetryDelay(err)
	require.True(t, ok, "RetryInfo")
	require.Positive(t, d)
	_, err = h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("a", 1)}})
	apierrtest.RequireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	h.redis.Start(t)
}

// Issue 18 item 14: IngestStream checks v2 membership on every batch, so a
// member released mid-stream stops writing at its next batch; nothing of
// that batch is stored.
func TestIngestStreamRechecksMembershipOnEveryBatch(t *testing.T) {
	h := start(t)
	ctx := context.Background()
	_, err := h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{
		RuntimeSessionId: "rs-m", SessionId: "ses-m", SandboxId: "sbx", Directory: "/w"}})
	require.NoError(t, err)
	h.credential.join("sbx", "/w", "rs-m")
	md := v2("sbx", "/w", "rs-m")

	stream, err := h.client.IngestStream(ctx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs-m", Scope: md, Items: []*ingestv1.Item{pbItem("a", 1)}}))
	require.Eventually(t, func() bool {
		resp, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs-m"})
		return err == nil && len(resp.GetItems()) == 1
	}, 20*time.Second, 10*time.Millisecond, "the first batch is stored while the member is live")

	h.credential.leave("sbx", "/w", "rs-m") // the member is released mid-stream
	require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs-m", Scope: md, Items: []*ingestv1.Item{pbItem("b", 1)}}))
	_, err = stream.CloseAndRecv()
	apierrtest.RequireStatus(t, err, codes.PermissionDenied, "SCOPE_MISMATCH")
	resp, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs-m"})
	require.NoError(t, err)
	require.Len(t, resp.GetItems(), 1, "the batch after the release was not stored")
}
