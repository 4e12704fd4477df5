package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"

	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/usage"
)

// UsageReport is the token usage of one provider response, attributed to
// the session its handle resolved through.
type UsageReport struct {
	SessionID, RuntimeSessionID, SandboxID string
	// Model the response named (or, when it named none, the request).
	Model                 string
	Input, Output, Cached uint64
}

// UsageSink takes the usage of each provider response that reported one.
// The proxy calls it before the response's last byte reaches the runtime,
// so the usage of a turn's requests is recorded before the runtime can
// end the turn; it must bound its own time.
type UsageSink interface {
	RecordUsage(ctx context.Context, u UsageReport)
}

// maxUsageRewrite bounds the chat completion request body the proxy reads
// whole to ask a stream for its usage; a larger body streams through
// unchanged (its response reports usage only if the caller asked).
const maxUsageRewrite = 4 << 20

// askForUsage reads a streamed chat completion's body (up to
// maxUsageRewrite) and adds stream_options.include_usage when the caller
// did not set stream_options, so the stream's last chunk carries the
// usage. It returns the request's model. Only that member is added;
// nothing else of the body changes.
func askForUsage(out *http.Request) (model string, err error) {
	if out.Body == nil {
		return "", nil
	}
	head, err := io.ReadAll(io.LimitReader(out.Body, maxUsageRewrite+1))
	if err != nil {
		return "", err
	}
	if len(head) > maxUsageRewrite {
		out.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(head), out.Body), out.Body}
		return "", nil
	}
	_ = out.Body.Close()
	req := usage.ParseRequest(head)
	body, _ := usage.AskForUsage(head, req)
	out.Body, out.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	if len(body) == 0 {
		out.Body = nil
	}
	return req.Model, nil
}

// usageTap reads a provider response's usage as its body streams to the
// caller, and reports it before the body's end is sent.
type usageTap struct {
	p     *Proxy
	sink  UsageSink
	res   *grants.Resolved
	model string // the request's
	r     *usage.Reader
}

// start looks at the response head: only a successful response of a
// format the reader knows is read.
func (t *usageTap) start(resp *http.Response) {
	if t == nil || resp.StatusCode < 200 || resp.StatusCode > 299 {
		return
	}
	if f := usage.FormatOf(resp.Header.Get("Content-Type")); f != usage.None {
		t.r = usage.NewReader(f)
	}
}

func (t *usageTap) active() bool { return t != nil && t.r != nil }

// report sends what the body reported, if anything.
func (t *usageTap) report(ctx context.Context) {
	u := t.r.Usage()
	t.r = nil
	if !u.Found {
		return
	}
	if u.Model == "" {
		u.Model = t.model
	}
	rep := UsageReport{
		SessionID: t.res.Member.SessionID, RuntimeSessionID: t.res.Member.RuntimeSessionID,
		SandboxID: t.res.Grant.Scope.SandboxID, Model: u.Model, Input: u.Input, Output: u.Output, Cached: u.Cached,
	}
	if t.sink == nil { // reporting is off (no session service): no history item either
		return
	}
	t.sink.RecordUsage(ctx, rep)
	t.p.recordUsageItem(ctx, t.res, rep)
}

// usageItemWait bounds writing a usage item to the history.
const usageItemWait = 2 * time.Second

// recordUsageItem adds the usage to the runtime session's history (so
// ExportHistory carries it): one status item per response,
// {"status":"usage","model","input_tokens","output_tokens","cached_tokens"},
// under a fresh id. A failure is logged and dropped.
func (p *Proxy) recordUsageItem(ctx context.Context, res *grants.Resolved, u UsageReport) {
	rsid := res.Member.RuntimeSessionID
	if p == nil || p.cfg.Ingest == nil || rsid == "" {
		return
	}
	meta, ok := scopeMetadata(res, rsid)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), usageItemWait)
	defer cancel()
	var id [12]byte
	_, _ = rand.Read(id[:])
	payload, _ := json.Marshal(map[string]any{"status": "usage", "model": u.Model,
		"input_tokens": u.Input, "output_tokens": u.Output, "cached_tokens": min(u.Cached, u.Input)})
	err := p.register(ctx, res, rsid)
	if err == nil {
		_, err = p.cfg.Ingest.Ingest(ctx, &ingestv1.IngestRequest{RuntimeSessionId: rsid, Scope: meta, Items: []*ingestv1.Item{{
			ItemId: "usage-" + hex.EncodeToString(id[:]), Type: ingestv1.ItemType_ITEM_TYPE_STATUS, Version: 1,
			Payload: payload, Time: timestamppb.New(p.cfg.Now()),
		}}})
	}
	if err != nil {
		p.cfg.Logger.WarnContext(ctx, "usage item to the history failed", "session_id", u.SessionID, "error", err.Error())
	}
}
