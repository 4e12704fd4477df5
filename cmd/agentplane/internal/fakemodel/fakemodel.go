// Package fakemodel is a small OpenAI-compatible model server for tests and
// benchmarks of real coding agents: POST /v1/chat/completions, streamed as
// server-sent events when the request asks for it, plain JSON otherwise. It
// plays a fixed script chosen by the last message, so an agent's whole turn
// (text, a tool call, the tool's result, the answer) runs without a model:
//
//   - a request without tools (an agent's title or summary request) gets a
//     short title;
//   - a last message from a tool gets the closing answer (ToolDone after
//     `write`, RunDone after `bash`);
//   - a user message containing "create hello.txt" gets a call of the
//     agent's file-writing tool (`write`, `{filePath, content}`) for
//     hello.txt in the working directory the prompt names; one
//     containing "create <absolute path>/hello.txt" gets the same call for
//     exactly that path;
//   - a user message "write: <path> <text>" gets a call of `write` for the
//     text and a newline at path in that working directory, and a user
//     message "run: <command>" gets a call of the agent's shell tool
//     (`bash`, `{command}`, with `description` and `workdir` when the
//     tool's schema has them) for the command: the steering of the scripted
//     runtime (services/sandbox/runtime/scripted), so one test drives either
//     runtime with the same messages;
//   - a user message containing "slow" streams a first chunk and then holds
//     the stream open until the client goes away (or Hold passes);
//   - anything else gets a streamed greeting.
//
// It records every request's Authorization header, so a test can check that
// the model saw the backing secret and never the sandbox's handle.
//
// Every JSON reply, and every stream whose request asked for it
// (stream_options.include_usage, as OpenAI's API), reports token usage in
// OpenAI's shape: prompt_tokens 100 + 10 per message, completion_tokens 5
// per text chunk or 7 for a tool call, and prompt_tokens_details
// .cached_tokens 4 after the first message; the record of the request
// holds what it reported.
package fakemodel

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path"
	"regexp"
	"strings"
	"sync"
	"time"
)

// Reply texts of the script.
const (
	Title        = "Agentplane test session"
	Greeting     = "Hello from the fake model."
	ToolDone     = "Created hello.txt in the workspace."
	FileContent  = "hello from agentplane\n"
	WriteTool    = "write"
	ShellTool    = "bash"
	RunDone      = "Ran the command."
	SlowFirstBit = "Thinking slowly"
)

// Request is what the server recorded of one chat completion.
type Request struct {
	Authorization string
	Attestation   string
	Stream        bool
	Tools         []string
	// ToolSchemas holds each offered tool's parameters (JSON Schema), by name.
	ToolSchemas map[string]json.RawMessage
	LastRole    string
	LastText    string
	Messages    int // how many messages the request carried
	// Prompt is the text of every message of the request, one after the
	// other (system prompt, history, tool results).
	Prompt string
	// WorkDir is the working directory the agent's prompt names
	// ("Working directory: ..." in the first message that has one), if any.
	WorkDir string
	Time    time.Time
	// IncludeUsage: the request asked a stream for its usage.
	IncludeUsage bool
	// Usage is what the reply reported (zero: none; a stream that was not
	// asked, or a reply the client left before its end).
	Usage Usage
}

// Usage is the token usage a reply reported.
type Usage struct {
	PromptTokens, CompletionTokens, CachedTokens uint64
}

// Server is the fake model. The zero value is not usable; call New.
type Server struct {
	// Hold bounds how long a "slow" reply keeps its stream open.
	Hold time.Duration

	mu       sync.Mutex
	requests []Request
	notify   chan struct{}
}

// New returns a server with a 2 minute hold.
func New() *Server { return &Server{Hold: 2 * time.Minute, notify: make(chan struct{})} }

// Requests returns a copy of what was recorded so far.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.requests...)
}

// Changed returns a channel closed at the next recorded request.
func (s *Server) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.notify
}

type chatMessage struct {
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	ToolCalls []struct {
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	} `json:"tool_calls"`
}

type chatRequest struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Messages []chatMessage `json:"messages"`
	Tools    []struct {
		Function struct {
			Name       string          `json:"name"`
			Parameters json.RawMessage `json:"parameters"`
		} `json:"function"`
	} `json:"tools"`
}

// text flattens a message content: a string, or a list of parts with text.
func text(raw json.RawMessage) string {
	return strings.Join(textParts(raw), "")
}

// textParts is a message content's text: a string, or each part's text.
func textParts(raw json.RawMessage) []string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []string{s}
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	_ = json.Unmarshal(raw, &parts)
	out := make([]string, 0, len(parts))
	for _, p := range parts {
		out = append(out, p.Text)
	}
	return out
}

// steering is the part of a user message that starts with one of the
// scripted runtime's prefixes ("write: ", "run: "), if any: an agent may add
// parts of its own around the user's text.
func steering(raw json.RawMessage) (prefix, rest string) {
	for _, p := range textParts(raw) {
		for _, pre := range []string{"write: ", "run: "} {
			if r, ok := strings.CutPrefix(strings.TrimLeft(p, " \t\n"), pre); ok {
				return pre, r
			}
		}
	}
	return "", ""
}

var workdirRE = regexp.MustCompile(`Working directory: (\S+)`)

// createAtRE is a request to create hello.txt at an absolute path.
var createAtRE = regexp.MustCompile(`(?i)create (/\S*/hello\.txt)\b`)

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || !strings.HasSuffix(r.URL.Path, "/chat/completions") {
		http.Error(w, `{"error":{"message":"not found"}}`, http.StatusNotFound)
		return
	}
	var req chatRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 16<<20)).Decode(&req); err != nil {
		http.Error(w, `{"error":{"message":"bad json"}}`, http.StatusBadRequest)
		return
	}
	rec := Request{Authorization: r.Header.Get("Authorization"), Attestation: r.Header.Get("X-Agentplane-Attestation"),
		Stream: req.Stream, IncludeUsage: req.StreamOptions.IncludeUsage, Time: time.Now()}
	for _, t := range req.Tools {
		rec.Tools = append(rec.Tools, t.Function.Name)
		if rec.ToolSchemas == nil {
			rec.ToolSchemas = map[string]json.RawMessage{}
		}
		rec.ToolSchemas[t.Function.Name] = t.Function.Parameters
	}
	in := input{}
	rec.Messages = len(req.Messages)
	if n := len(req.Messages); n > 0 {
		last := req.Messages[n-1]
		rec.LastRole, rec.LastText = last.Role, text(last.Content)
		var prompt strings.Builder
		for _, msg := range req.Messages {
			prompt.WriteString(text(msg.Content))
			prompt.WriteString("\n")
		}
		rec.Prompt = prompt.String()
		for _, msg := range req.Messages { // opencode: the system prompt; kilo: a later message
			if m := workdirRE.FindStringSubmatch(text(msg.Content)); m != nil {
				in.workdir = m[1]
				rec.WorkDir = in.workdir
				break
			}
		}
		if last.Role == "user" {
			in.prefix, in.rest = steering(last.Content)
		}
		// The tool whose result this is: the last assistant message's call.
		for i := n - 1; i >= 0 && last.Role == "tool"; i-- {
			if c := req.Messages[i].ToolCalls; req.Messages[i].Role == "assistant" && len(c) > 0 {
				in.calledTool = c[len(c)-1].Function.Name
				break
			}
		}
	}
	rep := s.script(rec, in)
	u := usageOf(rec, rep)
	s.mu.Lock()
	i := len(s.requests)
	s.requests = append(s.requests, rec)
	close(s.notify)
	s.notify = make(chan struct{})
	s.mu.Unlock()

	rep.callID = fmt.Sprintf("call_%d", i+1) // unique, as a model's are: an agent may key its tool calls by it
	reported := false
	if !req.Stream {
		writeJSON(w, req.Model, rep, u)
		reported = true
	} else {
		reported = s.stream(w, r, req.Model, rep, u, rec.IncludeUsage)
	}
	if reported {
		s.mu.Lock()
		s.requests[i].Usage = u
		s.mu.Unlock()
	}
}

// usageOf is the usage a reply reports (see the package comment).
func usageOf(rec Request, rep reply) Usage {
	u := Usage{PromptTokens: 100 + 10*uint64(rec.Messages), CompletionTokens: 5 * uint64(len(rep.chunks))}
	if rep.toolName != "" {
		u.CompletionTokens += 7
	}
	if rec.Messages > 1 {
		u.CachedTokens = 4
	}
	return u
}

func (u Usage) json() map[string]any {
	return map[string]any{"prompt_tokens": u.PromptTokens, "completion_tokens": u.CompletionTokens,
		"total_tokens": u.PromptTokens + u.CompletionTokens, "prompt_tokens_details": map[string]any{"cached_tokens": u.CachedTokens}}
}

// reply is one scripted answer: text chunks, or a tool call.
type reply struct {
	chunks   []string
	toolName string
	toolArgs string
	callID   string
	slow     bool
}

// input is what the script reads of a request besides the record.
type input struct {
	workdir      string // the working directory the prompt names
	prefix, rest string // a user message's steering ("write: ", "run: ") and the text after it
	calledTool   string // the tool whose result the last message is
}

func (s *Server) script(rec Request, in input) reply {
	last := strings.ToLower(rec.LastText)
	inWorkdir := func(file string) string {
		if in.workdir != "" && !path.IsAbs(file) {
			return path.Join(in.workdir, file)
		}
		return file
	}
	switch {
	case len(rec.Tools) == 0 && rec.Stream:
		return reply{chunks: []string{Title}}
	case rec.LastRole == "tool" && in.calledTool == ShellTool:
		return reply{chunks: []string{"Ran ", "the command."}}
	case rec.LastRole == "tool":
		return reply{chunks: []string{"Created ", "hello.txt ", "in the workspace."}}
	case in.prefix == "write: " && hasTool(rec.Tools, WriteTool):
		file, content, _ := strings.Cut(in.rest, " ")
		args, _ := json.Marshal(map[string]string{"filePath": inWorkdir(file), "content": content + "\n"})
		return reply{chunks: []string{"I'll write the file."}, toolName: WriteTool, toolArgs: string(args)}
	case in.prefix == "run: " && hasTool(rec.Tools, ShellTool):
		args := map[string]string{"command": in.rest}
		props := schemaProperties(rec.ToolSchemas[ShellTool])
		if props["description"] {
			args["description"] = "Runs the command the user gave"
		}
		if props["workdir"] && in.workdir != "" {
			args["workdir"] = in.workdir
		}
		b, _ := json.Marshal(args)
		return reply{chunks: []string{"I'll run it."}, toolName: ShellTool, toolArgs: string(b)}
	case rec.LastRole == "user" && (strings.Contains(last, "create hello.txt") || createAtRE.MatchString(rec.LastText)) && hasTool(rec.Tools, WriteTool):
		file := inWorkdir("hello.txt")
		if m := createAtRE.FindStringSubmatch(rec.LastText); m != nil {
			file = m[1] // the user's own absolute path, as given
		}
		args, _ := json.Marshal(map[string]string{"filePath": file, "content": FileContent})
		return reply{chunks: []string{"I'll create the file."}, toolName: WriteTool, toolArgs: string(args)}
	case strings.Contains(last, "slow"):
		return reply{chunks: []string{SlowFirstBit}, slow: true}
	}
	return reply{chunks: []string{"Hello ", "from the ", "fake model."}}
}

// schemaProperties names the properties of a tool's parameter schema.
func schemaProperties(schema json.RawMessage) map[string]bool {
	var sc struct {
		Properties map[string]json.RawMessage `json:"properties"`
	}
	_ = json.Unmarshal(schema, &sc)
	out := map[string]bool{}
	for k := range sc.Properties {
		out[k] = true
	}
	return out
}

func hasTool(tools []string, name string) bool {
	for _, t := range tools {
		if t == name {
			return true
		}
	}
	return false
}

func writeJSON(w http.ResponseWriter, model string, rep reply, u Usage) {
	msg := map[string]any{"role": "assistant", "content": strings.Join(rep.chunks, "")}
	finish := "stop"
	if rep.toolName != "" {
		msg["tool_calls"] = []map[string]any{{"id": rep.callID, "type": "function",
			"function": map[string]any{"name": rep.toolName, "arguments": rep.toolArgs}}}
		finish = "tool_calls"
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"id": "chatcmpl-fake", "object": "chat.completion", "created": time.Now().Unix(), "model": model,
		"choices": []map[string]any{{"index": 0, "message": msg, "finish_reason": finish}},
		"usage":   u.json(),
	})
}

// stream answers with server-sent events; it reports whether it sent the
// usage (asked for, and the client stayed to the end).
func (s *Server) stream(w http.ResponseWriter, r *http.Request, model string, rep reply, u Usage, includeUsage bool) bool {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	flusher, _ := w.(http.Flusher)
	created := time.Now().Unix()
	send := func(delta map[string]any, finish any) {
		chunk := map[string]any{"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created, "model": model,
			"choices": []map[string]any{{"index": 0, "delta": delta, "finish_reason": finish}}}
		b, _ := json.Marshal(chunk)
		fmt.Fprintf(w, "data: %s\n\n", b)
		if flusher != nil {
			flusher.Flush()
		}
	}
	for i, c := range rep.chunks {
		d := map[string]any{"content": c}
		if i == 0 {
			d["role"] = "assistant"
		}
		send(d, nil)
	}
	if rep.slow {
		select {
		case <-r.Context().Done():
			return false
		case <-time.After(s.Hold):
		}
	}
	finish := "stop"
	if rep.toolName != "" {
		send(map[string]any{"tool_calls": []map[string]any{{"index": 0, "id": rep.callID, "type": "function",
			"function": map[string]any{"name": rep.toolName, "arguments": rep.toolArgs}}}}, nil)
		finish = "tool_calls"
	}
	send(map[string]any{}, finish)
	if includeUsage {
		usage, _ := json.Marshal(map[string]any{"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created, "model": model,
			"choices": []any{}, "usage": u.json()})
		fmt.Fprintf(w, "data: %s\n\n", usage)
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
	if flusher != nil {
		flusher.Flush()
	}
	return includeUsage && r.Context().Err() == nil
}
