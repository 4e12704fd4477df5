package grpcapi_test

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/apierr/apierrtest"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/paging"
	"agentplane.dev/services/ingest/internal/grpcapi"
)

func pbItem(id string, version uint64) *ingestv1.Item {
	return &ingestv1.Item{
		ItemId: id, Type: ingestv1.ItemType_ITEM_TYPE_MESSAGE, Version: version,
		Payload: fmt.Appendf(nil, `{"id":%q,"v":%d}`, id, version),
		Time:    timestamppb.New(time.Unix(1700000000, 0)),
	}
}

func requireItems(t *testing.T, want, got []*ingestv1.Item) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		require.True(t, proto.Equal(want[i], got[i]), "item %d: want %v got %v", i, want[i], got[i])
	}
}

func TestStoreExportTailDelete(t *testing.T) {
	h := start(t)
	ctx := context.Background()

	created, err := h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{
		RuntimeSessionId: "rs-1", SessionId: "ses-1", SandboxId: "sbx", Directory: "/w",
	}})
	require.NoError(t, err)
	require.Equal(t, "ses-1", created.GetRuntimeSession().GetSessionId())
	require.NotNil(t, created.GetRuntimeSession().GetCreateTime())

	// Ingest: a batch.
	res, err := h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("a", 1), pbItem("b", 1)}})
	require.NoError(t, err)
	require.Equal(t, int32(2), res.GetApplied())
	firstCursor := res.GetCursor()
	require.NotEmpty(t, firstCursor)

	// IngestStream: several batches, one of them a replay.
	stream, err := h.client.IngestStream(ctx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("a", 2)}}))
	require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("a", 1), pbItem("c", 3)}}))
	require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("a", 2)}}))
	total, err := stream.CloseAndRecv()
	require.NoError(t, err)
	require.Equal(t, int64(3), total.GetBatches())
	require.Equal(t, int64(2), total.GetApplied())
	require.Equal(t, int64(2), total.GetIgnored())

	// Export: the newest version of every item, ordered by id.
	exp, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs-1"})
	require.NoError(t, err)
	requireItems(t, []*ingestv1.Item{pbItem("a", 2), pbItem("b", 1), pbItem("c", 3)}, exp.GetItems())
	require.Equal(t, total.GetCursor(), exp.GetCursor())

	// Tail from the first batch's cursor: the later versions, then follows new ones.
	tailCtx, cancelTail := context.WithCancel(ctx)
	defer cancelTail()
	tail, err := h.client.Tail(tailCtx, &ingestv1.TailRequest{RuntimeSessionId: "rs-1", Cursor: firstCursor})
	require.NoError(t, err)
	var cursors []string
	for _, want := range []*ingestv1.Item{pbItem("a", 2), pbItem("c", 3)} {
		got, err := tail.Recv()
		require.NoError(t, err)
		require.True(t, proto.Equal(want, got.GetItem()), "%v", got.GetItem())
		cursors = append(cursors, got.GetCursor())
	}
	require.Equal(t, exp.GetCursor(), cursors[1])
	_, err = h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("d", 1)}})
	require.NoError(t, err)
	got, err := tail.Recv()
	require.NoError(t, err)
	require.True(t, proto.Equal(pbItem("d", 1), got.GetItem()))

	// Resume from the export cursor: only what came after it.
	resumed, err := h.client.Tail(tailCtx, &ingestv1.TailRequest{RuntimeSessionId: "rs-1", Cursor: exp.GetCursor()})
	require.NoError(t, err)
	got, err = resumed.Recv()
	require.NoError(t, err)
	require.True(t, proto.Equal(pbItem("d", 1), got.GetItem()))

	// Delete: tombstone; every call answers NOT_FOUND, and open tails end with it.
	_, err = h.client.Delete(ctx, &ingestv1.DeleteRequest{RuntimeSessionId: "rs-1"})
	require.NoError(t, err)
	_, err = tail.Recv()
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionDeleted)
	_, err = resumed.Recv()
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionDeleted)

	_, err = h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs-1"})
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionDeleted)
	_, err = h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "rs-1", Items: []*ingestv1.Item{pbItem("a", 9)}})
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionDeleted)
	again, err := h.client.Tail(ctx, &ingestv1.TailRequest{RuntimeSessionId: "rs-1"})
	require.NoError(t, err)
	_, err = again.Recv()
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionDeleted)
	_, err = h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{RuntimeSessionId: "rs-1"}})
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionDeleted)
	_, err = h.client.Delete(ctx, &ingestv1.DeleteRequest{RuntimeSessionId: "rs-1"})
	require.NoError(t, err, "delete is idempotent")
	keys, err := h.rdb.Keys(ctx, "ing:{rs-1}:*").Result()
	require.NoError(t, err)
	require.Equal(t, []string{"ing:{rs-1}:meta"}, keys, "only the tombstone is left")
}

func TestUnknownRuntimeSession(t *testing.T) {
	h := start(t)
	ctx := context.Background()
	_, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "nobody"})
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionNotFound)
	tail, err := h.client.Tail(ctx, &ingestv1.TailRequest{RuntimeSessionId: "nobody"})
	require.NoError(t, err)
	_, err = tail.Recv()
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionNotFound)

	_, err = h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{RuntimeSessionId: "rs", SessionId: "a"}})
	require.NoError(t, err)
	_, err = h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{RuntimeSessionId: "rs", SessionId: "b"}})
	apierrtest.RequireStatus(t, err, codes.AlreadyExists, grpcapi.ReasonRuntimeSessionConflict)
	// A created session with no items exports nothing, with no cursor.
	exp, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs"})
	require.NoError(t, err)
	require.Empty(t, exp.GetItems())
	require.Empty(t, exp.GetCursor())
}

func TestRequiresInternalToken(t *testing.T) {
	h := start(t)
	_, err := h.anonymous.Export(context.Background(), &ingestv1.ExportRequest{RuntimeSessionId: "rs"})
	require.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
}

// violationFields lists the BadRequest field violations of err.
func violationFields(err error) []string {
	var fields []string
	for _, v := range apierr.FieldViolations(err) {
		fields = append(fields, v.GetField())
	}
	return fields
}

func jsonOfSize(n int) []byte {
	return []byte(`"` + strings.Repeat("x", n-2) + `"`)
}

func TestLimitsStoreNothing(t *testing.T) {
	h := start(t)
	ctx := context.Background()
	fill := func(n int) []*ingestv1.Item {
		items := make([]*ingestv1.Item, n)
		for i := range items {
			items[i] = pbItem(fmt.Sprintf("i%d", i), 1)
		}
		return items
	}
	oversizeItem := fill(4)
	oversizeItem[3].Payload = jsonOfSize(2<<20 + 1)
	heavyBatch := fill(3)
	for _, it := range heavyBatch {
		it.Payload = jsonOfSize(1<<20 + 512<<10)
	}
	badJSON := fill(2)
	badJSON[1].Payload = []byte(`{"a":`)
	badFields := fill(3)
	badFields[0].ItemId = "has space"
	badFields[1].Version = 0
	badFields[2].Type = ingestv1.ItemType_ITEM_TYPE_UNSPECIFIED

	tests := []struct {
		name   string
		items  []*ingestv1.Item
		reason string
		fields []string
	}{
		{"item over 2 MiB", oversizeItem, grpcapi.ReasonLimitExceeded, []string{"items[3].payload"}},
		{"batch over 128 items", fill(129), grpcapi.ReasonLimitExceeded, []string{"items"}},
		{"batch over 4 MiB", heavyBatch, grpcapi.ReasonLimitExceeded, []string{"items"}},
		{"payload not JSON", badJSON, grpcapi.ReasonInvalidRequest, []string{"items[1].payload"}},
		{"bad id, version, type", badFields, grpcapi.ReasonInvalidRequest, []string{"items[0].item_id", "items[1].version", "items[2].type"}},
		{"empty batch", nil, grpcapi.ReasonInvalidRequest, []string{"items"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "rs", Items: tt.items})
			apierrtest.RequireStatus(t, err, codes.InvalidArgument, tt.reason)
			require.Equal(t, tt.fields, violationFields(err))

			stream, err := h.client.IngestStream(ctx)
			require.NoError(t, err)
			require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs", Items: tt.items}))
			_, err = stream.CloseAndRecv()
			apierrtest.RequireStatus(t, err, codes.InvalidArgument, tt.reason)
			require.Equal(t, tt.fields, violationFields(err))

			keys, err := h.rdb.Keys(ctx, "ing:*").Result()
			require.NoError(t, err)
			require.Empty(t, keys, "nothing of the batch is stored")
		})
	}

	_, err := h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "bad/id", Items: fill(1)})
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, grpcapi.ReasonInvalidRequest)
	require.Equal(t, []string{"runtime_session_id"}, violationFields(err))
	tail, err := h.client.Tail(ctx, &ingestv1.TailRequest{RuntimeSessionId: "rs", Cursor: "not-a-cursor"})
	require.NoError(t, err)
	_, err = tail.Recv()
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, grpcapi.ReasonInvalidRequest)
	require.Equal(t, []string{"cursor"}, violationFields(err))
}

func TestStreamKeepsEarlierBatchesWhenALaterOneFails(t *testing.T) {
	h := start(t)
	ctx := context.Background()
	stream, err := h.client.IngestStream(ctx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs", Items: []*ingestv1.Item{pbItem("a", 1)}}))
	bad := pbItem("b", 1)
	bad.Payload = []byte("nope")
	_ = stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs", Items: []*ingestv1.Item{pbItem("c", 1), bad}})
	_, err = stream.CloseAndRecv()
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, grpcapi.ReasonInvalidRequest)
	require.Equal(t, []string{"items[1].payload"}, violationFields(err))

	exp, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs"})
	require.NoError(t, err)
	requireItems(t, []*ingestv1.Item{pbItem("a", 1)}, exp.GetItems())
}

func v1(id string) *ingestv1.ScopeMetadata {
	return &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V1{V1: &ingestv1.ScopeV1{RuntimeSessionId: id}}}
}

func v2(sandbox, dir, resolving string) *ingestv1.ScopeMetadata {
	return &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V2{V2: &ingestv1.ScopeV2{
		SandboxId: sandbox, Directory: dir, ResolvingRuntimeSessionId: resolving, OrgId: "o1", UserId: "u1",
	}}}
}

// allCalls runs every scoped RPC for target with md and returns their errors by name.
func allCalls(t *testing.T, h *harness, md *ingestv1.ScopeMetadata, target string) map[string]error {
	t.Helper()
	ctx := context.Background()
	errs := map[string]error{}
	_, errs["Ingest"] = h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: target, Scope: md, Items: []*ingestv1.Item{pbItem("x", 1)}})
	stream, err := h.client.IngestStream(ctx)
	require.NoError(t, err)
	_ = stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: target, Scope: md, Items: []*ingestv1.Item{pbItem("y", 1)}})
	_, errs["IngestStream"] = stream.CloseAndRecv()
	_, errs["Export"] = h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: target, Scope: md})
	tailCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	tail, err := h.client.Tail(tailCtx, &ingestv1.TailRequest{RuntimeSessionId: target, Scope: md})
	require.NoError(t, err)
	_, errs["Tail"] = tail.Recv() // the first stored item, or the refusal
	return errs
}

func requireAll(t *testing.T, errs map[string]error, code codes.Code, reason string) {
	t.Helper()
	require.Len(t, errs, 4)
	for name, err := range errs {
		if code == codes.OK {
			require.NoError(t, err, name)
			continue
		}
		require.Equal(t, code, status.Code(err), "%s: %v", name, err)
		require.Equal(t, reason, apierr.Reason(err), "%s: %v", name, err)
	}
}

func TestScopeV1(t *testing.T) {
	h := start(t)
	requireAll(t, allCalls(t, h, v1("rs-own"), "rs-own"), codes.OK, "")
	requireAll(t, allCalls(t, h, v1("rs-own"), "rs-other"), codes.PermissionDenied, grpcapi.ReasonScopeMismatch)
	requireAll(t, allCalls(t, h, v1(""), "rs-other"), codes.PermissionDenied, grpcapi.ReasonScopeMismatch)
	keys, err := h.rdb.Keys(context.Background(), "ing:{rs-other}:*").Result()
	require.NoError(t, err)
	require.Empty(t, keys, "a refused ingest stores nothing")
	// Without scope metadata (internal token callers) any runtime session is admitted.
	requireAll(t, allCalls(t, h, nil, "rs-other"), codes.OK, "")
}

func TestScopeV2(t *testing.T) {
	h := start(t)
	h.credential.join("sbx", "/w", "rs-a")
	h.credential.join("sbx", "/w", "rs-b")
	h.credential.join("sbx", "/other", "rs-c")

	// A sibling member root and the resolving member's own root.
	requireAll(t, allCalls(t, h, v2("sbx", "/w", "rs-a"), "rs-b"), codes.OK, "")
	requireAll(t, allCalls(t, h, v2("sbx", "/w", "rs-a"), "rs-a"), codes.OK, "")
	// Another scope's member root, by directory and by sandbox.
	requireAll(t, allCalls(t, h, v2("sbx", "/w", "rs-a"), "rs-c"), codes.PermissionDenied, grpcapi.ReasonScopeMismatch)
	requireAll(t, allCalls(t, h, v2("sbx-2", "/w", "rs-a"), "rs-b"), codes.PermissionDenied, grpcapi.ReasonScopeMismatch)

	// A deleted member's root is refused, even with its history still stored.
	h.credential.leave("sbx", "/w", "rs-b")
	requireAll(t, allCalls(t, h, v2("sbx", "/w", "rs-a"), "rs-b"), codes.PermissionDenied, grpcapi.ReasonScopeMismatch)
	// A handle resolving through a member that left reaches nobody.
	h.credential.join("sbx", "/w", "rs-b")
	h.credential.leave("sbx", "/w", "rs-a")
	requireAll(t, allCalls(t, h, v2("sbx", "/w", "rs-a"), "rs-b"), codes.PermissionDenied, grpcapi.ReasonScopeMismatch)

	// Malformed v2 metadata is INVALID_ARGUMENT with field violations.
	_, err := h.client.Export(context.Background(), &ingestv1.ExportRequest{RuntimeSessionId: "rs-b", Scope: v2("", "", "")})
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, grpcapi.ReasonInvalidRequest)
	require.Equal(t, []string{"scope.v2.sandbox_id", "scope.v2.directory", "scope.v2.resolving_runtime_session_id"}, violationFields(err))

	// The credential service failing is retryable, never an admission.
	h.credential.mu.Lock()
	h.credential.failing = true
	h.credential.mu.Unlock()
	errs := allCalls(t, h, v2("sbx", "/w", "rs-b"), "rs-b")
	requireAll(t, errs, codes.Unavailable, grpcapi.ReasonScopeCheckUnavailable)
	delay, ok := apierr.RetryDelay(errs["Ingest"])
	require.True(t, ok)
	require.Positive(t, delay)

	h.credential.mu.Lock()
	defer h.credential.mu.Unlock()
	require.NotEmpty(t, h.credential.tokens)
	for _, tok := range h.credential.tokens {
		require.Equal(t, "Bearer "+internalToken, tok)
	}
}

// v2 membership is asked on every batch (issue 18 item 14; it was once per
// stream, so a member released mid-stream kept writing).
func TestIngestStreamChecksMembershipOnEveryV2Batch(t *testing.T) {
	h := start(t)
	h.credential.join("sbx", "/w", "rs-a")
	ctx := context.Background()
	stream, err := h.client.IngestStream(ctx)
	require.NoError(t, err)
	for v := range uint64(5) {
		require.NoError(t, stream.Send(&ingestv1.IngestStreamRequest{RuntimeSessionId: "rs-a", Scope: v2("sbx", "/w", "rs-a"), Items: []*ingestv1.Item{pbItem("a", v+1)}}))
	}
	total, err := stream.CloseAndRecv()
	require.NoError(t, err)
	require.Equal(t, int64(5), total.GetBatches())
	h.credential.mu.Lock()
	defer h.credential.mu.Unlock()
	require.Equal(t, 5, h.credential.calls)
}

func TestExportPages(t *testing.T) {
	h := start(t)
	ctx := context.Background()
	// Five items of 1.5 MiB: one response would not fit a default 4 MiB client limit.
	var want []*ingestv1.Item
	for i := range 5 {
		it := pbItem(fmt.Sprintf("big-%d", i), 1)
		it.Payload = jsonOfSize(1<<20 + 512<<10)
		want = append(want, it)
		_, err := h.client.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: "rs", Items: []*ingestv1.Item{it}})
		require.NoError(t, err)
	}
	var got []*ingestv1.Item
	token, pages := "", 0
	for {
		resp, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs", PageSize: 100, PageToken: token},
			grpc.MaxCallRecvMsgSize(4<<20)) // the gRPC default, stated
		require.NoError(t, err)
		pages++
		got = append(got, resp.GetItems()...)
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	require.Equal(t, 3, pages, "two 1.5 MiB items per 3 MiB page")
	requireItems(t, want, got)

	_, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs", PageSize: -1, PageToken: "!!"})
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, grpcapi.ReasonInvalidRequest)
	require.Equal(t, []string{"page_size", "page_token"}, violationFields(err))
	// The cap every list call shares (pkg/paging): above it is refused, not clamped.
	for _, size := range []int32{paging.MaxPageSize + 1, math.MaxInt32} {
		_, err = h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs", PageSize: size})
		apierrtest.RequireStatus(t, err, codes.InvalidArgument, grpcapi.ReasonInvalidRequest)
		require.Equal(t, []string{"page_size"}, violationFields(err))
	}
	resp, err := h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs", PageSize: paging.MaxPageSize})
	require.NoError(t, err)
	require.NotEmpty(t, resp.GetItems())
}

// Issue 19 item 7: CreateRuntimeSession refuses what the public API refuses
// in its ids and directory, each with a field violation; nothing is stored.
func TestCreateRuntimeSessionValidatesIDsAndDirectory(t *testing.T) {
	h := start(t)
	ctx := context.Background()
	_, err := h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{
		RuntimeSessionId: "rs-1", SessionId: "s/..", SandboxId: "..", Directory: "../x",
	}})
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, grpcapi.ReasonInvalidRequest)
	require.Equal(t, []string{"runtime_session.session_id", "runtime_session.sandbox_id", "runtime_session.directory"}, violationFields(err))
	for _, id := range []string{"..", ".", "a/b", "rs:1"} {
		_, err = h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{RuntimeSessionId: id}})
		require.Equal(t, []string{"runtime_session.runtime_session_id"}, violationFields(err), id)
	}
	_, err = h.client.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: "rs-1"})
	apierrtest.RequireStatus(t, err, codes.NotFound, grpcapi.ReasonRuntimeSessionNotFound)
	_, err = h.client.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{
		RuntimeSessionId: "rs-1", SessionId: "s1", SandboxId: "sbx-a", Directory: "/w/repo",
	}})
	require.NoError(t, err)
}
