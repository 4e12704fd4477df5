package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"agentplane.dev/pkg/apierr"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
)

// maxIngestBody bounds a JSON batch: ingest takes at most 4 MiB of items,
// and JSON framing adds a little.
const maxIngestBody = 6 << 20

// ItemJSON is one history item as runtimes post it.
type ItemJSON struct {
	ItemID   string          `json:"item_id"`
	Type     string          `json:"type"`
	Version  uint64          `json:"version"`
	ParentID string          `json:"parent_id,omitempty"`
	Payload  json.RawMessage `json:"payload,omitempty"`
	Time     *time.Time      `json:"time,omitempty"`
}

// BatchJSON is the body of POST .../ingest/v1/sessions/{id}/items.
type BatchJSON struct {
	Items []ItemJSON `json:"items"`
}

var itemTypes = map[string]ingestv1.ItemType{
	"session": ingestv1.ItemType_ITEM_TYPE_SESSION, "message": ingestv1.ItemType_ITEM_TYPE_MESSAGE,
	"part": ingestv1.ItemType_ITEM_TYPE_PART, "diff": ingestv1.ItemType_ITEM_TYPE_DIFF,
	"status": ingestv1.ItemType_ITEM_TYPE_STATUS, "open": ingestv1.ItemType_ITEM_TYPE_OPEN,
	"close": ingestv1.ItemType_ITEM_TYPE_CLOSE, "notification": ingestv1.ItemType_ITEM_TYPE_NOTIFICATION,
}

func typeName(t ingestv1.ItemType) string {
	for k, v := range itemTypes {
		if v == t {
			return k
		}
	}
	return strings.ToLower(strings.TrimPrefix(t.String(), "ITEM_TYPE_"))
}

// serveIngest handles ingest/v1/sessions/{runtime_session_id}/{items|export|title}.
// The network policy admits a per-session handle to its own runtime session
// (v1 metadata) and a worktree handle to any live member root of its scope
// (v2 metadata naming the member it resolved through).
// ServeHTTP has checked the operation and its method (ingestOp).
func (p *Proxy) serveIngest(w http.ResponseWriter, r *http.Request, t Target, res *grants.Resolved) {
	rsid, op := t.Rest[2], t.Rest[3]
	meta, ok := scopeMetadata(res, rsid)
	if !ok {
		p.deny(w, "policy", http.StatusForbidden, "runtime session not admitted for this handle")
		return
	}
	if p.cfg.Ingest == nil {
		writeError(w, http.StatusServiceUnavailable, "ingest unavailable")
		return
	}
	if op == "export" {
		resp, err := p.cfg.Ingest.Export(r.Context(), &ingestv1.ExportRequest{RuntimeSessionId: rsid, Scope: meta})
		if err != nil {
			writeGRPCError(w, err)
			return
		}
		out := struct {
			Items  []ItemJSON `json:"items"`
			Cursor string     `json:"cursor"`
		}{Items: []ItemJSON{}, Cursor: resp.GetCursor()}
		for _, it := range resp.GetItems() {
			out.Items = append(out.Items, itemToJSON(it))
		}
		writeJSON(w, http.StatusOK, out)
		return
	}
	if op == "title" {
		p.serveTitle(w, r, res, rsid, meta)
		return
	}
	var batch BatchJSON
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxIngestBody))
	if err := dec.Decode(&batch); err != nil {
		writeError(w, http.StatusBadRequest, "body is not a JSON batch")
		return
	}
	if err := p.register(r.Context(), res, rsid); err != nil {
		writeGRPCError(w, err)
		return
	}
	req := &ingestv1.IngestRequest{RuntimeSessionId: rsid, Scope: meta}
	for _, it := range batch.Items {
		typ, ok := itemTypes[it.Type]
		if !ok {
			writeError(w, http.StatusBadRequest, "unknown item type")
			return
		}
		item := &ingestv1.Item{ItemId: it.ItemID, Type: typ, Version: it.Version, ParentId: it.ParentID, Payload: it.Payload}
		if it.Time != nil {
			item.Time = timestamppb.New(*it.Time)
		}
		req.Items = append(req.Items, item)
	}
	p.ingest(w, r, req)
}

// ingest sends req to ingest and answers with what it applied, ignored and
// the cursor: the answer of both write routes, items and title.
func (p *Proxy) ingest(w http.ResponseWriter, r *http.Request, req *ingestv1.IngestRequest) {
	resp, err := p.cfg.Ingest.Ingest(r.Context(), req)
	if err != nil {
		writeGRPCError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"applied": resp.GetApplied(), "ignored": resp.GetIgnored(), "cursor": resp.GetCursor()})
}

// register creates the runtime session in ingest with its session, sandbox
// and directory before this process first writes to it. The proxy does it
// (not the sandbox) because it is the one place that sees both the grant's
// member and the first write; CreateRuntimeSession is idempotent, so other
// replicas and restarts repeating it are harmless.
func (p *Proxy) register(ctx context.Context, res *grants.Resolved, rsid string) error {
	if _, ok := p.registered.Load(rsid); ok {
		return nil
	}
	sessionID := res.Member.SessionID
	for _, m := range res.Grant.Members {
		if m.RuntimeSessionID == rsid {
			sessionID = m.SessionID
		}
	}
	_, err := p.cfg.Ingest.CreateRuntimeSession(ctx, &ingestv1.CreateRuntimeSessionRequest{RuntimeSession: &ingestv1.RuntimeSession{
		RuntimeSessionId: rsid, SessionId: sessionID, SandboxId: res.Grant.Scope.SandboxID, Directory: res.Grant.Scope.Directory,
	}})
	if err != nil {
		return err
	}
	if p.registeredN.Add(1) > maxRegistered {
		// Bound the memory; forgetting only costs one idempotent call.
		p.registered.Clear()
		p.registeredN.Store(1)
	}
	p.registered.Store(rsid, struct{}{})
	return nil
}

// maxRegistered bounds the set of runtime sessions known to be registered.
const maxRegistered = 100_000

// ingestOp returns the operation of an ingest path,
// v1/sessions/{runtime_session_id}/{items|export|title}.
func ingestOp(t Target) (string, bool) {
	rest := t.Rest
	if len(rest) != 4 || rest[0] != "v1" || rest[1] != "sessions" || rest[2] == "" {
		return "", false
	}
	_, ok := ingestMethods[rest[3]]
	return rest[3], ok
}

func scopeMetadata(res *grants.Resolved, rsid string) (*ingestv1.ScopeMetadata, bool) {
	if res.Grant.Kind == handle.PerSession {
		if rsid != res.Member.RuntimeSessionID {
			return nil, false
		}
		return &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V1{V1: &ingestv1.ScopeV1{RuntimeSessionId: rsid}}}, true
	}
	if !slices.ContainsFunc(res.Grant.Members, func(m scope.Member) bool { return m.RuntimeSessionID == rsid }) {
		return nil, false
	}
	return &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V2{V2: &ingestv1.ScopeV2{
		SandboxId: res.Grant.Scope.SandboxID, Directory: res.Grant.Scope.Directory,
		ResolvingRuntimeSessionId: res.Member.RuntimeSessionID,
		OrgId:                     res.Member.OrgID, UserId: res.Member.UserID,
	}}}, true
}

func itemToJSON(it *ingestv1.Item) ItemJSON {
	j := ItemJSON{ItemID: it.GetItemId(), Type: typeName(it.GetType()), Version: it.GetVersion(), ParentID: it.GetParentId()}
	if p := it.GetPayload(); len(p) > 0 {
		if json.Valid(p) {
			j.Payload = p
		} else {
			j.Payload, _ = json.Marshal(p) // not JSON: a base64 string
		}
	}
	if it.GetTime() != nil {
		t := it.GetTime().AsTime()
		j.Time = &t
	}
	return j
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// httpStatus maps an ingest gRPC status to the HTTP status a runtime sees.
var httpStatus = map[codes.Code]int{
	codes.InvalidArgument: http.StatusBadRequest, codes.NotFound: http.StatusNotFound,
	codes.AlreadyExists: http.StatusConflict, codes.PermissionDenied: http.StatusForbidden,
	codes.Unauthenticated: http.StatusUnauthorized, codes.FailedPrecondition: http.StatusPreconditionFailed,
	codes.ResourceExhausted: http.StatusTooManyRequests, codes.Unavailable: http.StatusServiceUnavailable,
	codes.DeadlineExceeded: http.StatusGatewayTimeout, codes.Aborted: http.StatusConflict,
}

// writeGRPCError forwards ingest's code, reason and field violations; a
// non-status error (a broken connection) is a 502.
func writeGRPCError(w http.ResponseWriter, err error) {
	st, ok := status.FromError(err)
	if !ok || errors.Is(err, http.ErrAbortHandler) {
		writeError(w, http.StatusBadGateway, "ingest unavailable")
		return
	}
	code, ok := httpStatus[st.Code()]
	if !ok {
		code = http.StatusBadGateway
	}
	body := map[string]any{"code": code, "grpc_code": st.Code().String(), "reason": apierr.Reason(err), "message": st.Message()}
	if fv := apierr.FieldViolations(err); len(fv) > 0 {
		var vs []map[string]string
		for _, v := range fv {
			vs = append(vs, map[string]string{"field": v.GetField(), "description": v.GetDescription()})
		}
		body["field_violations"] = vs
	}
	writeJSON(w, code, map[string]any{"error": body})
}
