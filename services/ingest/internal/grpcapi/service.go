// Package grpcapi implements agentplane.ingest.v1.IngestService: it converts between protobuf
// and the history domain, applies the scope rules, and maps errors in one place (errors.go).
package grpcapi

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"log/slog"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/ident"
	"agentplane.dev/pkg/paging"
	"agentplane.dev/services/ingest/internal/history"
	"agentplane.dev/services/ingest/internal/scope"
	"agentplane.dev/services/ingest/internal/store"
)

// Service is the IngestService server.
type Service struct {
	ingestv1.UnimplementedIngestServiceServer
	store  *store.Store
	scopes scope.Admitter
	log    *slog.Logger
	obs    *Metrics // nil until Observe (metrics.go)
}

// New returns the service on st, asking members about v2 scope membership.
func New(st *store.Store, members scope.MemberChecker, log *slog.Logger) *Service {
	return &Service{store: st, scopes: scope.Admitter{Members: members}, log: log.With("component", "ingest")}
}

// Flow-control windows for ingest traffic. gRPC's default 64 KiB stream window (grown by
// BDP probes) makes a 128 KiB batch wait for window updates, round trip by round trip; a
// static window that holds whole batches lets a client stream them back to back. The
// connection window bounds what one client can have buffered in the server.
const (
	streamWindow     = 4 << 20
	connectionWindow = 16 << 20
)

// recvBuffers holds received messages. gRPC's default pool jumps from 32 KiB to 1 MiB
// buffers and zeroes a pooled buffer's whole capacity on every Get, so each ~130 KiB batch
// cost a 1 MiB clear; power-of-two tiers up to the 8 MiB message limit bound that waste
// to under 2x the message.
var recvBuffers = func() mem.BufferPool {
	p, err := mem.NewBinaryTieredBufferPool(8, 12, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23)
	if err != nil {
		panic(err) // the exponents are constants
	}
	return p
}()

// ServerOptions are the transport settings the ingest service runs with.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connectionWindow),
		experimental.BufferPool(recvBuffers),
	}
}

// Register registers s on reg.
func (s *Service) Register(reg grpc.ServiceRegistrar) { ingestv1.RegisterIngestServiceServer(reg, s) }

// CreateRuntimeSession registers a runtime session; idempotent.
func (s *Service) CreateRuntimeSession(ctx context.Context, req *ingestv1.CreateRuntimeSessionRequest) (*ingestv1.CreateRuntimeSessionResponse, error) {
	rs := req.GetRuntimeSession()
	vs := history.ValidateRuntimeSessionID("runtime_session.runtime_session_id", rs.GetRuntimeSessionId())
	// The session, sandbox and directory are optional (a runtime session first seen through
	// Ingest has none), but when given they obey the rules of every API.
	vs = append(vs, history.ValidateRef("runtime_session.session_id", rs.GetSessionId(), ident.OptionalID)...)
	vs = append(vs, history.ValidateRef("runtime_session.sandbox_id", rs.GetSandboxId(), ident.OptionalID)...)
	if rs.GetDirectory() != "" {
		vs = append(vs, history.ValidateRef("runtime_session.directory", rs.GetDirectory(), ident.Directory)...)
	}
	if err := history.Invalid(vs); err != nil {
		return nil, s.toStatus(ctx, err)
	}
	stored, err := s.store.CreateRuntimeSession(ctx, history.RuntimeSession{
		ID: rs.GetRuntimeSessionId(), SessionID: rs.GetSessionId(), SandboxID: rs.GetSandboxId(), Directory: rs.GetDirectory(),
	})
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &ingestv1.CreateRuntimeSessionResponse{RuntimeSession: runtimeSessionToProto(stored)}, nil
}

// batch is one validated, admitted batch ready to store.
type batch struct {
	runtimeSessionID string
	md               scope.Metadata
	items            []history.Item
}

// checkBatch validates a batch completely: nothing of a batch with any violation is stored.
func checkBatch(id string, pbScope *ingestv1.ScopeMetadata, pbItems []*ingestv1.Item) (batch, error) {
	vs := history.ValidateRuntimeSessionID("runtime_session_id", id)
	md, scopeVs := scopeFromProto(pbScope)
	vs = append(vs, scopeVs...)
	items := itemsFromProto(pbItems)
	vs = append(vs, history.ValidateBatch(items)...)
	return batch{runtimeSessionID: id, md: md, items: items}, history.Invalid(vs)
}

// Ingest stores one batch atomically.
func (s *Service) ingest(ctx context.Context, req *ingestv1.IngestRequest) (*ingestv1.IngestResponse, error) {
	b, err := checkBatch(req.GetRuntimeSessionId(), req.GetScope(), req.GetItems())
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	if err := s.scopes.Admit(ctx, b.md, b.runtimeSessionID); err != nil {
		return nil, s.toStatus(ctx, err)
	}
	res, err := s.store.Ingest(ctx, b.runtimeSessionID, b.items)
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &ingestv1.IngestResponse{Applied: int32(res.Applied), Ignored: int32(res.Ignored), Cursor: res.Cursor}, nil
}

// IngestStream stores each batch of a client stream atomically, in order. A bad batch ends
// the stream with its error; the batches before it stay stored. While one batch is being
// stored the next is received, validated and encoded, so Redis and the CPU work overlap.
// Admission is remembered for the stream's lifetime per (scope, target): a stream is one
// request, and a revocation applies to requests that start after it.
func (s *Service) ingestStream(stream grpc.ClientStreamingServer[ingestv1.IngestStreamRequest, ingestv1.IngestStreamResponse]) error {
	ctx := stream.Context()
	admission := streamAdmission{scopes: s.scopes}
	w := batchWriter{ctx: ctx, s: s}
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			if err := w.wait(); err != nil {
				return err
			}
			return stream.SendAndClose(&w.total)
		}
		if err != nil {
			return w.fail(err) // the transport's status (cancelled, too large, ...)
		}
		b, err := checkBatch(req.GetRuntimeSessionId(), req.GetScope(), req.GetItems())
		if err != nil {
			return w.fail(s.toStatus(ctx, err))
		}
		if err := admission.admit(ctx, b); err != nil {
			return w.fail(s.toStatus(ctx, err))
		}
		if err := w.write(b.runtimeSessionID, store.Encode(b.items)); err != nil {
			return err
		}
	}
}

// streamAdmission admits a stream's batches. v2 admission depends on live
// membership, which a release ends at any time: every v2 batch is checked
// again, so a member released mid-stream stops writing with its next batch.
// v1 and internal admission depend on nothing that changes; they are checked
// once per (scope, target).
type streamAdmission struct {
	scopes   scope.Admitter
	admitted []admission
}

type admission struct {
	md     scope.Metadata
	target string
}

func (a *streamAdmission) admit(ctx context.Context, b batch) error {
	if b.md.V2 == nil && a.remembers(b) {
		return nil
	}
	if err := a.scopes.Admit(ctx, b.md, b.runtimeSessionID); err != nil {
		return err
	}
	if b.md.V2 == nil {
		a.admitted = append(a.admitted, admission{b.md, b.runtimeSessionID})
	}
	return nil
}

func (a *streamAdmission) remembers(b batch) bool {
	for _, ad := range a.admitted {
		if ad.target == b.runtimeSessionID && sameScope(ad.md, b.md) {
			return true
		}
	}
	return false
}

// batchWriter stores a stream's batches in the background, one at a time,
// and sums their results. At most one batch is being stored; wait collects
// it. Every return of the stream waits first, so no store call outlives the
// handler, and an earlier batch's error wins over a later one's.
type batchWriter struct {
	ctx     context.Context
	s       *Service
	total   ingestv1.IngestStreamResponse
	pending chan storedBatch
}

type storedBatch struct {
	res history.BatchResult
	err error
}

// write starts storing the batch for target once the one before it is stored.
func (w *batchWriter) write(target string, encoded store.EncodedBatch) error {
	if err := w.wait(); err != nil {
		return err
	}
	w.pending = make(chan storedBatch, 1)
	go func(ctx context.Context, st *store.Store, ch chan<- storedBatch) {
		res, err := st.IngestEncoded(ctx, target, encoded)
		ch <- storedBatch{res, err}
	}(w.ctx, w.s.store, w.pending)
	return nil
}

// wait collects the batch being stored, if any, into the total.
func (w *batchWriter) wait() error {
	if w.pending == nil {
		return nil
	}
	r := <-w.pending
	w.pending = nil
	if r.err != nil {
		return w.s.toStatus(w.ctx, r.err)
	}
	w.total.Applied += int64(r.res.Applied)
	w.total.Ignored += int64(r.res.Ignored)
	w.total.Batches++
	if r.res.Cursor != "" {
		w.total.Cursor = r.res.Cursor
	}
	return nil
}

// fail ends the stream with err, unless the batch being stored failed first.
func (w *batchWriter) fail(err error) error {
	if werr := w.wait(); werr != nil {
		return werr
	}
	return err
}

func sameScope(a, b scope.Metadata) bool {
	switch {
	case a.V1 != nil && b.V1 != nil:
		return *a.V1 == *b.V1
	case a.V2 != nil && b.V2 != nil:
		return *a.V2 == *b.V2
	default:
		return a.V1 == nil && b.V1 == nil && a.V2 == nil && b.V2 == nil
	}
}

// admitRead validates the target and scope of a read and applies the scope rules.
func (s *Service) admitRead(ctx context.Context, id string, pbScope *ingestv1.ScopeMetadata, extra ...history.Violation) error {
	vs := history.ValidateRuntimeSessionID("runtime_session_id", id)
	md, scopeVs := scopeFromProto(pbScope)
	vs = append(append(vs, scopeVs...), extra...)
	if err := history.Invalid(vs); err != nil {
		return err
	}
	return s.scopes.Admit(ctx, md, id)
}

// Export pages: page_size items at most (the shared rule of pkg/paging) and, beyond the
// first item, exportPageBytes of payloads, so a page fits a client's default 4 MiB
// receive limit.
const (
	exportPageBytes = 3 << 20
	pageTokenPrefix = "after:"
)

// Export returns the newest version of every item, ordered by item id, in pages when
// page_size is set.
func (s *Service) Export(ctx context.Context, req *ingestv1.ExportRequest) (*ingestv1.ExportResponse, error) {
	var extra []history.Violation
	page := store.Page{Limit: int(req.GetPageSize())}
	if d := paging.Check(req.GetPageSize()); d != "" {
		extra = append(extra, history.Violation{Field: "page_size", Description: d})
	}
	if page.Limit > 0 {
		page.MaxBytes = exportPageBytes
	}
	if tok := req.GetPageToken(); tok != "" {
		after, ok := decodePageToken(tok)
		if !ok {
			extra = append(extra, history.Violation{Field: "page_token", Description: "must be a next_page_token returned by this service"})
		}
		page.After = after
	}
	if err := s.admitRead(ctx, req.GetRuntimeSessionId(), req.GetScope(), extra...); err != nil {
		return nil, s.toStatus(ctx, err)
	}
	items, cursor, more, err := s.store.Export(ctx, req.GetRuntimeSessionId(), page)
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	resp := &ingestv1.ExportResponse{Items: make([]*ingestv1.Item, len(items)), Cursor: cursor}
	for i, it := range items {
		resp.Items[i] = itemToProto(it)
	}
	if more && len(items) > 0 {
		resp.NextPageToken = encodePageToken(items[len(items)-1].ID)
	}
	return resp, nil
}

// Page tokens are opaque to clients: the last item id of the page, base64url encoded.
func encodePageToken(lastID string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(pageTokenPrefix + lastID))
}

func decodePageToken(tok string) (string, bool) {
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return "", false
	}
	after, ok := strings.CutPrefix(string(raw), pageTokenPrefix)
	return after, ok && history.ValidID(after)
}

// Tail streams stored item versions after the request's cursor and follows new ones until
// the caller goes away or the runtime session is deleted (then NOT_FOUND).
func (s *Service) tail(req *ingestv1.TailRequest, stream grpc.ServerStreamingServer[ingestv1.TailResponse]) error {
	ctx := stream.Context()
	var extra []history.Violation
	if !validCursor(req.GetCursor()) {
		extra = append(extra, history.Violation{Field: "cursor", Description: "must be empty or a cursor returned by this service"})
	}
	if err := s.admitRead(ctx, req.GetRuntimeSessionId(), req.GetScope(), extra...); err != nil {
		return s.toStatus(ctx, err)
	}
	err := s.store.Tail(ctx, req.GetRuntimeSessionId(), req.GetCursor(), func(e history.Entry) error {
		return stream.Send(&ingestv1.TailResponse{Item: itemToProto(e.Item), Cursor: e.Cursor})
	})
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err() // the caller left; nothing to report
	}
	return s.toStatus(ctx, err)
}

// Delete tombstones a runtime session; internal callers only (the request has no scope).
func (s *Service) Delete(ctx context.Context, req *ingestv1.DeleteRequest) (*ingestv1.DeleteResponse, error) {
	if err := history.Invalid(history.ValidateRuntimeSessionID("runtime_session_id", req.GetRuntimeSessionId())); err != nil {
		return nil, s.toStatus(ctx, err)
	}
	if err := s.store.Delete(ctx, req.GetRuntimeSessionId()); err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &ingestv1.DeleteResponse{}, nil
}
