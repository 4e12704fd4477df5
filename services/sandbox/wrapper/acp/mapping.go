package acp

import (
	"encoding/json"
	"strings"

	"agentplane.dev/services/sandbox/internal/agent/runtimejsonl"
)

// ACP session/update kinds (schema: SessionUpdate.sessionUpdate).
const (
	updUserChunk    = "user_message_chunk"
	updAgentChunk   = "agent_message_chunk"
	updThoughtChunk = "agent_thought_chunk"
	updToolCall     = "tool_call"
	updToolUpdate   = "tool_call_update"
	updPlan         = "plan"
	updUsage        = "usage_update"
)

// Stop reasons (schema: StopReason) and the turn results they map to.
var stopReasons = map[string]struct{ result, reason string }{
	"end_turn":          {runtimejsonl.ResultSucceeded, ""},
	"cancelled":         {runtimejsonl.ResultCancelled, ""},
	"refusal":           {runtimejsonl.ResultFailed, "refusal"},
	"max_tokens":        {runtimejsonl.ResultFailed, "max_tokens"},
	"max_turn_requests": {runtimejsonl.ResultFailed, "max_turn_requests"},
}

// outcomeFor maps a prompt's stopReason; an unknown one fails the turn as a
// protocol error (the turn still settles exactly once).
func outcomeFor(stopReason string) (result, reason string) {
	if m, ok := stopReasons[stopReason]; ok {
		return m.result, m.reason
	}
	return runtimejsonl.ResultFailed, "agent_protocol_error"
}

// Bounds of what an event carries of the agent's raw tool input and output.
const (
	maxRaw     = 8 << 10
	maxText    = 16 << 10
	maxChunk   = 64 << 10  // one streamed chunk's text
	maxMessage = 256 << 10 // the full message at turn end
)

// update is the part of a SessionUpdate the mapping reads.
type update struct {
	SessionUpdate string          `json:"sessionUpdate"`
	Content       json.RawMessage `json:"content,omitempty"`
	MessageID     string          `json:"messageId,omitempty"`
	ToolCallID    string          `json:"toolCallId,omitempty"`
	Title         string          `json:"title,omitempty"`
	Kind          string          `json:"kind,omitempty"`
	Status        string          `json:"status,omitempty"`
	Locations     []struct {
		Path string `json:"path"`
		Line *int   `json:"line,omitempty"`
	} `json:"locations,omitempty"`
	RawInput  json.RawMessage `json:"rawInput,omitempty"`
	RawOutput json.RawMessage `json:"rawOutput,omitempty"`
	Entries   json.RawMessage `json:"entries,omitempty"`
}

// mapped is one RuntimeEvent-to-be (the runtime adds ids and time).
type mapped struct {
	kind, text, tool string
	data             map[string]any
}

// toolNames remembers each tool call's first title: an update may retitle
// the call (opencode retitles `write` with the path it wrote).
type toolNames map[string]string

// mapUpdate turns one session/update into events (pure). Every kind yields
// an event: the ones agentplane has no kind for are kept as status events
// that name the ACP update kind in data.acp_update, never dropped.
func mapUpdate(u update, raw json.RawMessage, names toolNames) []mapped {
	switch u.SessionUpdate {
	case updAgentChunk:
		return []mapped{{kind: runtimejsonl.KindMessageDelta, text: clip(blockText(u.Content), maxChunk),
			data: compact(map[string]any{"acp_update": u.SessionUpdate, "acp_message_id": u.MessageID})}}
	case updThoughtChunk:
		return []mapped{{kind: runtimejsonl.KindProgress, text: clip(blockText(u.Content), maxChunk),
			data: map[string]any{"acp_update": u.SessionUpdate, "thought": true}}}
	case updToolCall, updToolUpdate:
		name := names[u.ToolCallID]
		if name == "" {
			name = u.Title
			if name == "" {
				name = u.Kind
			}
			names[u.ToolCallID] = name
		}
		data := compact(map[string]any{
			"acp_update": u.SessionUpdate, "tool_call_id": u.ToolCallID, "title": u.Title,
			"tool_kind": u.Kind, "status": u.Status, "locations": locations(u),
			"raw_input": bounded(u.RawInput), "raw_output": bounded(u.RawOutput),
		})
		kind := runtimejsonl.KindToolCall
		text := ""
		if u.Status == "completed" || u.Status == "failed" {
			kind = runtimejsonl.KindToolResult
			text = clip(toolContentText(u.Content), maxText)
		}
		return []mapped{{kind: kind, text: text, tool: name, data: data}}
	case updPlan:
		return []mapped{{kind: runtimejsonl.KindProgress, text: "plan",
			data: compact(map[string]any{"acp_update": u.SessionUpdate, "entries": bounded(u.Entries)})}}
	case updUsage:
		return []mapped{{kind: runtimejsonl.KindStatus, text: "usage", data: map[string]any{"acp_update": u.SessionUpdate, "usage": bounded(raw)}}}
	case updUserChunk:
		return []mapped{{kind: runtimejsonl.KindStatus, text: u.SessionUpdate,
			data: map[string]any{"acp_update": u.SessionUpdate, "text": clip(blockText(u.Content), maxText)}}}
	}
	kind := u.SessionUpdate
	if kind == "" {
		kind = "unknown"
	}
	return []mapped{{kind: runtimejsonl.KindStatus, text: kind, data: map[string]any{"acp_update": kind, "update": bounded(raw)}}}
}

// blockText is the text of a ContentBlock (text blocks; a resource link by
// its URI; other blocks by their type).
func blockText(raw json.RawMessage) string {
	var b struct {
		Type string `json:"type"`
		Text string `json:"text"`
		URI  string `json:"uri"`
	}
	if json.Unmarshal(raw, &b) != nil {
		return ""
	}
	switch b.Type {
	case "text":
		return b.Text
	case "resource_link":
		return b.URI
	}
	return ""
}

// toolContentText joins the text of a tool call's content list.
func toolContentText(raw json.RawMessage) string {
	var items []struct {
		Type    string          `json:"type"`
		Content json.RawMessage `json:"content"`
		Path    string          `json:"path"`
	}
	if json.Unmarshal(raw, &items) != nil {
		return ""
	}
	var parts []string
	for _, it := range items {
		switch it.Type {
		case "content":
			if t := blockText(it.Content); t != "" {
				parts = append(parts, t)
			}
		case "diff":
			parts = append(parts, "diff "+it.Path)
		}
	}
	return strings.Join(parts, "\n")
}

func locations(u update) []any {
	if len(u.Locations) == 0 {
		return nil
	}
	out := make([]any, 0, len(u.Locations))
	for _, l := range u.Locations {
		m := map[string]any{"path": l.Path}
		if l.Line != nil {
			m["line"] = float64(*l.Line)
		}
		out = append(out, m)
	}
	return out
}

// bounded decodes raw JSON of at most maxRaw bytes; a larger value becomes
// its clipped text with a marker, so an event stays well under 64 KiB.
func bounded(raw json.RawMessage) any {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	if len(raw) > maxRaw {
		return map[string]any{"truncated": true, "bytes": float64(len(raw)), "prefix": clip(string(raw), maxRaw/2)}
	}
	var v any
	if json.Unmarshal(raw, &v) != nil {
		return nil
	}
	return v
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	// Cut on a rune boundary.
	for n > 0 && n < len(s) && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:n]
}

// compact drops empty values.
func compact(m map[string]any) map[string]any {
	for k, v := range m {
		switch x := v.(type) {
		case nil:
			delete(m, k)
		case string:
			if x == "" {
				delete(m, k)
			}
		case []any:
			if len(x) == 0 {
				delete(m, k)
			}
		}
	}
	return m
}
