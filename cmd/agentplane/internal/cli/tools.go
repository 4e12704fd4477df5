package cli

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/charmbracelet/x/ansi"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
)

// toolCall is what the people's view knows of one tool call: its updates
// (an ACP agent sends several per call: pending, in progress, completed)
// are merged into one line, written when the call ends.
type toolCall struct {
	name, input, status, detail string
}

// toolKey names the call an event belongs to: the ACP tool call id, else
// the tool's name (the scripted runtime's calls come one at a time, each
// followed by its result).
func toolKey(name string, data map[string]any) string {
	if id, _ := data["tool_call_id"].(string); id != "" {
		return "id:" + id
	}
	return "name:" + name
}

// tool merges a tool event into its call; a result writes the call's line.
func (h *human) tool(e *runtimev1.RuntimeEvent) {
	data := e.GetData().AsMap()
	key := toolKey(e.GetToolName(), data)
	c := h.tools[key]
	if c == nil {
		if h.tools == nil {
			h.tools = map[string]*toolCall{}
		}
		c = &toolCall{name: e.GetToolName()}
		h.tools[key] = c
		h.toolOrder = append(h.toolOrder, key)
	}
	result := e.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT
	if in := toolInput(c.name, data, result); in != "" {
		c.input = in
	}
	c.status, c.detail = toolStatus(data, e.GetText(), result)
	if !result {
		if h.tty {
			h.setProgress(strings.TrimSpace("running " + c.name + " " + c.input))
		}
		return
	}
	h.writeTool(key)
}

// flushTools writes the calls that never got a result (the turn ended).
func (h *human) flushTools() {
	for len(h.toolOrder) > 0 {
		h.writeTool(h.toolOrder[0])
	}
}

func (h *human) writeTool(key string) {
	c := h.tools[key]
	delete(h.tools, key)
	for i, k := range h.toolOrder {
		if k == key {
			h.toolOrder = append(h.toolOrder[:i], h.toolOrder[i+1:]...)
			break
		}
	}
	if c == nil {
		return
	}
	status := c.status
	style := h.dim
	switch status {
	case "completed":
		status = h.ok.Render("done")
	case "failed":
		status = h.bad.Render("failed")
	default:
		status = h.warn.Render(status)
	}
	if c.detail != "" {
		status += h.dim.Render(" (" + c.detail + ")")
	}
	line := "→ " + c.name
	if c.input != "" {
		line += " " + c.input
	}
	h.line(style.Render(line) + h.dim.Render(" · ") + status)
}

// inputKeys are the arguments that say what a tool call does, in the order
// they are looked for (opencode's, kilo's and the scripted runtime's).
var inputKeys = []string{"command", "cmd", "argv", "filePath", "file_path", "path", "pattern", "query", "url", "route", "description"}

// toolInput is a call's input in a few words: the agent's raw input (ACP),
// else the call's own data (the scripted runtime's), else where it acts.
func toolInput(name string, data map[string]any, result bool) string {
	src, ok := data["raw_input"].(map[string]any)
	if !ok && !result && data["acp_update"] == nil {
		src = data
	}
	for _, k := range inputKeys {
		switch v := src[k].(type) {
		case string:
			if v != "" {
				return clipPath(v, 60)
			}
		case []any:
			var parts []string
			for _, p := range v {
				parts = append(parts, fmt.Sprint(p))
			}
			return clip(strings.Join(parts, " "), 60)
		}
	}
	if len(src) > 0 {
		if b, err := json.Marshal(src); err == nil {
			return clip(string(b), 60)
		}
	}
	if locs, ok := data["locations"].([]any); ok && len(locs) > 0 {
		if l, ok := locs[0].(map[string]any); ok {
			if p, _ := l["path"].(string); p != "" {
				return clipPath(p, 60)
			}
		}
	}
	if title, _ := data["title"].(string); title != "" && title != name {
		return clipPath(title, 60)
	}
	return ""
}

// toolStatus is a call's state after an event: ACP's status when the agent
// gave one; for a result without one, failed when it says so (an error, a
// non-zero exit code, an HTTP error status, "tool failed") and completed
// otherwise. detail says a result's gist (exit code, HTTP status, error).
func toolStatus(data map[string]any, text string, result bool) (status, detail string) {
	if s, ok := data["status"].(string); ok && s != "" {
		status = s
	} else if result {
		status = "completed"
	} else {
		status = "pending"
	}
	if !result {
		return status, ""
	}
	if code, ok := data["exit_code"].(float64); ok {
		detail = fmt.Sprintf("exit %d", int(code))
		if code != 0 {
			status = "failed"
		}
	}
	if code, ok := data["status"].(float64); ok {
		detail = fmt.Sprintf("HTTP %d", int(code))
		if code >= 400 {
			status = "failed"
		}
	}
	if msg, _ := data["error"].(string); msg != "" {
		status, detail = "failed", clip(msg, 80)
	}
	if text == "tool failed" {
		status = "failed"
	} else if status == "failed" && detail == "" && text != "" {
		detail = clip(text, 80)
	}
	return status, detail
}

// clip is s on one line, cut to n characters.
func clip(s string, n int) string {
	return ansi.Truncate(strings.Join(strings.Fields(s), " "), n, "…")
}

// clipPath is clip for what may be a path: a long path keeps its end (the
// file's name), not its start.
func clipPath(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	r := []rune(s)
	if strings.ContainsRune(s, ' ') || !strings.ContainsRune(s, '/') || len(r) <= n {
		return clip(s, n)
	}
	return "…" + string(r[len(r)-n+1:])
}
