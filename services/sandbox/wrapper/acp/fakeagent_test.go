package acp

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"
)

// envFakeAgent makes the test binary a small ACP agent (see fakeAgent).
const envFakeAgent = "ACP_FAKE_AGENT"

// fakeAgent is a real child process speaking ACP on stdio, with one way
// to behave per mode:
//
//	good     answers everything; a prompt streams a thought, text, a tool
//	         call and its result, then end_turn; "slow" waits for
//	         session/cancel; "perm" asks permission first; "refuse" ends
//	         with refusal
//	garbage  writes a line that is not JSON when prompted
//	silent   never answers initialize
//	twice    answers a prompt twice
//	exit     exits in the middle of a prompt
//	noload   good, but does not offer loadSession
//	loadfail good, but session/load answers an error
func fakeAgent(mode string) {
	out := bufio.NewWriter(os.Stdout)
	send := func(v any) {
		b, _ := json.Marshal(v)
		_, _ = out.Write(append(b, '\n'))
		_ = out.Flush()
	}
	update := func(sid string, u map[string]any) {
		send(map[string]any{"jsonrpc": "2.0", "method": "session/update", "params": map[string]any{"sessionId": sid, "update": u}})
	}
	result := func(id json.RawMessage, r any) {
		send(map[string]any{"jsonrpc": "2.0", "id": id, "result": r})
	}
	cancelled := make(chan string, 16)
	replies := make(chan json.RawMessage, 16)
	sessions := 0
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	lines := make(chan []byte)
	go func() {
		for sc.Scan() {
			lines <- append([]byte(nil), sc.Bytes()...)
		}
		close(lines)
	}()
	var prompts []func()
	for {
		var line []byte
		var ok bool
		if len(prompts) > 0 {
			p := prompts[0]
			prompts = prompts[1:]
			p()
			continue
		}
		line, ok = <-lines
		if !ok {
			return
		}
		var m struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
			Params json.RawMessage `json:"params"`
			Result json.RawMessage `json:"result"`
		}
		_ = json.Unmarshal(line, &m)
		if m.Method == "" {
			replies <- m.Result
			continue
		}
		var p struct {
			SessionID string `json:"sessionId"`
			Prompt    []struct {
				Text string `json:"text"`
			} `json:"prompt"`
		}
		_ = json.Unmarshal(m.Params, &p)
		switch m.Method {
		case "initialize":
			if mode == "silent" {
				continue
			}
			result(m.ID, map[string]any{"protocolVersion": 1, "agentCapabilities": map[string]any{"loadSession": mode != "noload", "sessionCapabilities": map[string]any{"close": map[string]any{}}}})
		case "session/new":
			sessions++
			result(m.ID, map[string]any{"sessionId": fmt.Sprintf("fake-%d-%d", os.Getpid(), sessions)})
			update(fmt.Sprintf("fake-%d-%d", os.Getpid(), sessions), map[string]any{"sessionUpdate": "available_commands_update", "availableCommands": []any{}})
		case "session/load":
			if mode == "loadfail" {
				send(map[string]any{"jsonrpc": "2.0", "id": m.ID, "error": map[string]any{"code": -32002, "message": "session not found"}})
				continue
			}
			update(p.SessionID, map[string]any{"sessionUpdate": "user_message_chunk", "content": map[string]any{"type": "text", "text": "old"}})
			result(m.ID, map[string]any{})
		case "session/close":
			result(m.ID, map[string]any{})
		case "session/cancel":
			cancelled <- p.SessionID
		case "session/prompt":
			text := ""
			if len(p.Prompt) > 0 {
				text = p.Prompt[0].Text
			}
			id, sid := m.ID, p.SessionID
			switch mode {
			case "garbage":
				_, _ = out.WriteString("this is not json\n")
				_ = out.Flush()
				continue
			case "exit":
				update(sid, map[string]any{"sessionUpdate": "agent_message_chunk", "content": map[string]any{"type": "text", "text": "bye"}})
				os.Exit(3)
			case "twice":
				result(id, map[string]any{"stopReason": "end_turn"})
				result(id, map[string]any{"stopReason": "end_turn"})
				continue
			}
			if strings.Contains(text, "call the model") {
				// Like a real agent: read the provider config the wrapper
				// wrote, call its base URL with its key, and report what the
				// process can see of credentials.
				update(sid, map[string]any{"sessionUpdate": "agent_message_chunk", "content": map[string]any{"type": "text", "text": callModel()}})
				result(id, map[string]any{"stopReason": "end_turn"})
				continue
			}
			if strings.Contains(text, "perm") {
				send(map[string]any{"jsonrpc": "2.0", "id": 900, "method": "session/request_permission", "params": map[string]any{
					"sessionId": sid, "toolCall": map[string]any{"toolCallId": "t-perm", "title": "rm", "kind": "delete"},
					"options": []any{map[string]any{"optionId": "yes", "name": "Allow", "kind": "allow_once"}, map[string]any{"optionId": "no", "name": "Reject", "kind": "reject_once"}},
				}})
				// The reply comes on stdin; play the rest once it is read.
				prompts = append(prompts, func() {
					var r struct {
						Outcome struct {
							Outcome, OptionID string
						} `json:"outcome"`
					}
					select {
					case raw := <-replies:
						_ = json.Unmarshal(raw, &r)
					case line, ok := <-lines:
						if ok {
							var m struct {
								Result json.RawMessage `json:"result"`
							}
							_ = json.Unmarshal(line, &m)
							_ = json.Unmarshal(m.Result, &r)
						}
					}
					update(sid, map[string]any{"sessionUpdate": "agent_message_chunk", "content": map[string]any{"type": "text", "text": "permission:" + r.Outcome.OptionID}})
					result(id, map[string]any{"stopReason": "end_turn"})
				})
				continue
			}
			if strings.Contains(text, "slow") {
				update(sid, map[string]any{"sessionUpdate": "agent_message_chunk", "content": map[string]any{"type": "text", "text": "thinking"}})
				prompts = append(prompts, func() {
					for {
						select {
						case <-cancelled:
							result(id, map[string]any{"stopReason": "cancelled"})
							return
						case line, ok := <-lines:
							if !ok {
								return
							}
							if strings.Contains(string(line), "session/cancel") {
								result(id, map[string]any{"stopReason": "cancelled"})
								return
							}
						case <-time.After(60 * time.Second):
							result(id, map[string]any{"stopReason": "end_turn"})
							return
						}
					}
				})
				continue
			}
			update(sid, map[string]any{"sessionUpdate": "agent_thought_chunk", "content": map[string]any{"type": "text", "text": "hmm"}})
			update(sid, map[string]any{"sessionUpdate": "plan", "entries": []any{map[string]any{"content": "write it", "priority": "high", "status": "pending"}}})
			update(sid, map[string]any{"sessionUpdate": "agent_message_chunk", "content": map[string]any{"type": "text", "text": "Hello "}})
			update(sid, map[string]any{"sessionUpdate": "tool_call", "toolCallId": "t1", "title": "write", "kind": "edit", "status": "pending", "rawInput": map[string]any{"filePath": "x"}})
			update(sid, map[string]any{"sessionUpdate": "tool_call_update", "toolCallId": "t1", "title": "x", "status": "completed",
				"content": []any{map[string]any{"type": "content", "content": map[string]any{"type": "text", "text": "Wrote file"}}}, "rawOutput": map[string]any{"ok": true}})
			update(sid, map[string]any{"sessionUpdate": "usage_update", "used": 10, "size": 100})
			update(sid, map[string]any{"sessionUpdate": "some_future_kind", "x": 1})
			update(sid, map[string]any{"sessionUpdate": "agent_message_chunk", "content": map[string]any{"type": "text", "text": "world"}})
			stop := "end_turn"
			if strings.Contains(text, "refuse") {
				stop = "refusal"
			}
			result(id, map[string]any{"stopReason": stop})
		default:
			if len(m.ID) > 0 {
				send(map[string]any{"jsonrpc": "2.0", "id": m.ID, "error": map[string]any{"code": -32601, "message": "no"}})
			}
		}
	}
}

// callModel posts a chat completion to the base URL of the config named by
// FAKE_CONFIG and returns "status|pid|config text|environment|argv".
func callModel() string {
	file := os.Getenv("FAKE_CONFIG")
	raw, err := os.ReadFile(file)
	if err != nil {
		return "no config: " + err.Error()
	}
	var cfg struct {
		BaseURL string `json:"baseURL"`
		APIKey  string `json:"apiKey"`
	}
	_ = json.Unmarshal(raw, &cfg)
	req, _ := http.NewRequest(http.MethodPost, cfg.BaseURL+"/chat/completions", strings.NewReader(`{"model":"m","messages":[]}`))
	req.Header.Set("Authorization", "Bearer "+cfg.APIKey)
	status := "unreachable"
	if resp, err := http.DefaultClient.Do(req); err == nil {
		status = resp.Status
		_ = resp.Body.Close()
	}
	return strings.Join([]string{status, fmt.Sprint(os.Getpid()), string(raw), strings.Join(os.Environ(), " "), strings.Join(os.Args, " ")}, "|")
}
