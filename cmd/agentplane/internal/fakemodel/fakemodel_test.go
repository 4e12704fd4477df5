package fakemodel

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
)

// tools are an agent's offered tools: write, and a shell tool whose schema
// has the properties given.
func tools(shellProps ...string) []map[string]any {
	props := map[string]any{}
	for _, p := range shellProps {
		props[p] = map[string]any{"type": "string"}
	}
	return []map[string]any{
		{"type": "function", "function": map[string]any{"name": WriteTool, "parameters": map[string]any{"type": "object",
			"properties": map[string]any{"filePath": map[string]any{"type": "string"}, "content": map[string]any{"type": "string"}}}}},
		{"type": "function", "function": map[string]any{"name": ShellTool, "parameters": map[string]any{"type": "object", "properties": props}}},
	}
}

// complete posts one non-streamed request and returns the assistant message.
func complete(t *testing.T, s *Server, messages []map[string]any, offered []map[string]any) (content, tool string, args map[string]string) {
	t.Helper()
	content, tool, args, _ = completeWithID(t, s, messages, offered)
	return content, tool, args
}

// completeWithID is complete that also returns the tool call's id.
func completeWithID(t *testing.T, s *Server, messages []map[string]any, offered []map[string]any) (content, tool string, args map[string]string, id string) {
	t.Helper()
	body, err := json.Marshal(map[string]any{"model": "fake-model", "messages": messages, "tools": offered})
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body)))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	var resp struct {
		Choices []struct {
			Message struct {
				Content   string `json:"content"`
				ToolCalls []struct {
					ID       string `json:"id"`
					Function struct {
						Name      string `json:"name"`
						Arguments string `json:"arguments"`
					} `json:"function"`
				} `json:"tool_calls"`
			} `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &resp))
	require.Len(t, resp.Choices, 1)
	m := resp.Choices[0].Message
	if len(m.ToolCalls) > 0 {
		tool, id = m.ToolCalls[0].Function.Name, m.ToolCalls[0].ID
		require.NoError(t, json.Unmarshal([]byte(m.ToolCalls[0].Function.Arguments), &args))
	}
	return m.Content, tool, args, id
}

const system = "You are an agent.\nWorking directory: /work/alice\n"

func TestScriptSteersLikeTheScriptedRuntime(t *testing.T) {
	script := "for d in /proc/[0-9]*; do\necho $d\ndone"
	cases := []struct {
		name     string
		user     any // a string, or parts
		offered  []map[string]any
		wantTool string
		wantArgs map[string]string
	}{
		{"write in the working directory", "write: see.sh " + script, tools("command"),
			WriteTool, map[string]string{"filePath": "/work/alice/see.sh", "content": script + "\n"}},
		{"write an absolute path", "write: /tmp/x.txt a b", tools("command"),
			WriteTool, map[string]string{"filePath": "/tmp/x.txt", "content": "a b\n"}},
		{"run with the schema's command only", "run: sh see.sh", tools("command", "timeout"),
			ShellTool, map[string]string{"command": "sh see.sh"}},
		{"run fills description and workdir when the schema has them", "run: cat secret.txt", tools("command", "description", "workdir"),
			ShellTool, map[string]string{"command": "cat secret.txt", "description": "Runs the command the user gave", "workdir": "/work/alice"}},
		{"run from one part of several", []map[string]string{{"type": "text", "text": "run: dd if=/dev/zero of=filler bs=1M count=100"},
			{"type": "text", "text": "<system-reminder>be brief</system-reminder>"}}, tools("command"),
			ShellTool, map[string]string{"command": "dd if=/dev/zero of=filler bs=1M count=100"}},
		{"run without a shell tool is a greeting", "run: ls", tools()[:1], "", nil},
		{"steering only at the start", "please run: ls", tools("command"), "", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := New()
			_, tool, args := complete(t, s, []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": c.user}}, c.offered)
			require.Equal(t, c.wantTool, tool)
			require.Equal(t, c.wantArgs, args)
			reqs := s.Requests()
			require.Len(t, reqs, 1)
			require.JSONEq(t, string(mustJSON(t, c.offered[len(c.offered)-1]["function"].(map[string]any)["parameters"])),
				string(reqs[0].ToolSchemas[c.offered[len(c.offered)-1]["function"].(map[string]any)["name"].(string)]), "the schema is recorded")
		})
	}
}

// TestToolCallIDsAreUnique: an agent keys its tool calls by the model's id
// (opencode passes it on as the ACP toolCallId), so two turns' calls must
// not share one.
func TestToolCallIDsAreUnique(t *testing.T) {
	s := New()
	seen := map[string]bool{}
	for _, msg := range []string{"write: a.txt a", "run: cat a.txt", "run: cat a.txt"} {
		_, tool, _, id := completeWithID(t, s, []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": msg}}, tools("command"))
		require.NotEmpty(t, tool, msg)
		require.NotEmpty(t, id, msg)
		require.False(t, seen[id], "id %s given twice", id)
		seen[id] = true
	}
}

func TestClosingAnswerNamesTheTool(t *testing.T) {
	for tool, want := range map[string]string{ShellTool: RunDone, WriteTool: ToolDone} {
		t.Run(tool, func(t *testing.T) {
			content, called, _ := complete(t, New(), []map[string]any{
				{"role": "system", "content": system},
				{"role": "user", "content": "run: ls"},
				{"role": "assistant", "content": "", "tool_calls": []map[string]any{{"id": "call_1", "type": "function",
					"function": map[string]any{"name": tool, "arguments": "{}"}}}},
				{"role": "tool", "tool_call_id": "call_1", "content": "done"},
			}, tools("command"))
			require.Empty(t, called, "the closing answer calls nothing")
			require.Equal(t, want, content)
		})
	}
}

func mustJSON(t *testing.T, v any) []byte {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}
