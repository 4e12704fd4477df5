package acp

import (
	"context"
	"encoding/json"
	"time"

	"agentplane.dev/services/sandbox/internal/agent/ingestpost"
	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
)

// historyTimeout bounds one turn's history post, its retries included.
const historyTimeout = 20 * time.Second

// postHistory writes the turn to ingest through the proxy's ingest route
// (`<proxy_url>/ingest/v1/sessions/<runtime session>/items`, with the
// current handle): the session item, the user message, the assistant
// message with its text part, one part per tool call (input and output
// bounded) and the route's status. Items are versioned so a retry is
// idempotent: a post that failed in transit is sent again within
// historyTimeout. A failure is logged without the handle; history does not
// change the turn's outcome.
func (r *Runtime) postHistory(rt *route, m runtimejsonl.Frame, t *turn, reply, result string) {
	proxy, handle := r.relay.Target()
	if proxy == "" || handle == "" {
		return
	}
	now := time.Now().UTC()
	item := func(id, typ string, version uint64, parent string, payload map[string]any) map[string]any {
		it := map[string]any{"item_id": id, "type": typ, "version": version, "payload": payload, "time": now}
		if parent != "" {
			it["parent_id"] = parent
		}
		return it
	}
	user, answer := "msg-"+m.MessageID, "reply-"+m.MessageID
	items := []map[string]any{
		item("session", "session", 1, "", map[string]any{"runtime_session_id": rt.rsid, "directory": rt.dir,
			"agent": r.cfg.Spec.Profile, "model": r.cfg.Spec.Model, "acp_session_id": rt.acpID}),
		item(user, "message", 1, "session", map[string]any{"role": "user", "text": clip(m.Content, maxText)}),
		item(answer, "message", 1, "session", map[string]any{"role": "assistant", "text": clip(reply, maxMessage), "result": result}),
	}
	if reply != "" {
		items = append(items, item(answer+"-part-0", "part", 1, answer, map[string]any{"kind": "text", "text": clip(reply, maxMessage)}))
	}
	for i, tc := range t.tools {
		items = append(items, item(answer+"-tool-"+tc.ID, "part", 1, answer, compact(map[string]any{
			"kind": "tool_call", "index": float64(i), "tool_call_id": tc.ID, "title": tc.Title, "tool_kind": tc.Kind,
			"status": tc.Status, "input": tc.Input, "output": tc.Output,
		})))
	}
	items = append(items, item("status", "status", uint64(now.UnixNano()), "session",
		map[string]any{"state": "idle", "last_message_id": m.MessageID, "result": result}))
	body, err := json.Marshal(map[string]any{"items": items})
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), historyTimeout)
	defer cancel()
	if err := ingestpost.Post(ctx, r.http, proxy, handle, rt.rsid, body); err != nil {
		r.log.Warn("history post failed", "session", rt.sessionID, "err", err)
	}
}
