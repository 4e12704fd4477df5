// Command fakeacp is a minimal ACP agent for benchmarks and fault tests: it
// answers initialize, session/new and session/prompt. A prompt "bench N"
// streams N agent_message_chunk updates, each carrying the wall-clock time
// (Unix nanoseconds) at which it was written, 1 ms apart, then ends the
// turn; any other prompt gets one chunk. The benchmark also reads its
// stdout itself (the reference).
//
// It turns hostile on request: started in a directory whose name holds
// "silent-init" it never answers initialize; a prompt "fault garbage"
// writes a line that is not JSON, "fault twice" answers the prompt twice,
// "fault exit" exits in the middle of the turn.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

func main() {
	out := bufio.NewWriter(os.Stdout)
	send := func(v any) {
		b, _ := json.Marshal(v)
		_, _ = out.Write(append(b, '\n'))
		_ = out.Flush()
	}
	wd, _ := os.Getwd()
	silent := strings.Contains(filepath.Base(wd), "silent-init")
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	n := 0
	for sc.Scan() {
		var m struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
			Params struct {
				SessionID string `json:"sessionId"`
				Prompt    []struct {
					Text string `json:"text"`
				} `json:"prompt"`
			} `json:"params"`
		}
		if json.Unmarshal(sc.Bytes(), &m) != nil || len(m.ID) == 0 {
			continue
		}
		result := func(r any) { send(map[string]any{"jsonrpc": "2.0", "id": m.ID, "result": r}) }
		switch m.Method {
		case "initialize":
			if silent {
				continue
			}
			result(map[string]any{"protocolVersion": 1, "agentCapabilities": map[string]any{"loadSession": false}})
		case "session/new":
			n++
			result(map[string]any{"sessionId": fmt.Sprintf("bench-%d-%d", os.Getpid(), n)})
		case "session/prompt":
			text := ""
			if len(m.Params.Prompt) > 0 {
				text = m.Params.Prompt[0].Text
			}
			switch text {
			case "fault garbage":
				_, _ = out.WriteString("this is not json\n")
				_ = out.Flush()
				continue
			case "fault twice":
				result(map[string]any{"stopReason": "end_turn"})
				result(map[string]any{"stopReason": "end_turn"})
				continue
			case "fault exit":
				send(map[string]any{"jsonrpc": "2.0", "method": "session/update", "params": map[string]any{
					"sessionId": m.Params.SessionID, "update": map[string]any{"sessionUpdate": "agent_message_chunk",
						"content": map[string]any{"type": "text", "text": "bye"}}}})
				os.Exit(3)
			}
			count := 1
			if f := strings.Fields(text); len(f) == 2 && f[0] == "bench" {
				count, _ = strconv.Atoi(f[1])
			}
			for i := range count {
				if i > 0 {
					time.Sleep(time.Millisecond)
				}
				send(map[string]any{"jsonrpc": "2.0", "method": "session/update", "params": map[string]any{
					"sessionId": m.Params.SessionID, "update": map[string]any{"sessionUpdate": "agent_message_chunk",
						"content": map[string]any{"type": "text", "text": strconv.FormatInt(time.Now().UnixNano(), 10)}}}})
			}
			result(map[string]any{"stopReason": "end_turn"})
		default:
			send(map[string]any{"jsonrpc": "2.0", "id": m.ID, "error": map[string]any{"code": -32601, "message": "not supported"}})
		}
	}
}
