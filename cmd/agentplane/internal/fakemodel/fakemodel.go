// Package fakemodel is a small OpenAI-compatible model server for tests and
// benchmarks of real coding agents: POST /v1/chat/completions, streamed as
// server-sent events when the request asks for it, plain JSON otherwise. It
// plays a fixed script chosen by the last message, so an agent's whole turn
// (text, a tool call, the tool's result, the answer) runs without a model:
//
//   - a request without tools (an agent's title or summary request) gets a
//     short title;
//   - a last message from a tool gets the closing answer;
//   - a user message containing "create hello.txt" gets a call of the
//     agent's file-writing tool (`write`, `{filePath, content}`) for
//     hello.txt in the working directory the system prompt names;
//   - a user message containing "slow" streams a first chunk and then holds
//     the stream open until the client goes away (or Hold passes);
//   - anything else gets a streamed greeting.
//
// It records every request's Authorization header, so a test can check that
// the model saw the backing secret and never the sandbox's handle.
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
	SlowFirstBit = "Thinking slowly"
)

// Request is what the server recorded of one chat completion.
type Request struct {
	Authorization string
	Attestation   string
	Stream        bool
	Tools         []string
	LastRole      string
	LastText      string
	Messages      int // how many messages the request carried
	Time          time.Time
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
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type chatRequest struct {
	Model    string        `json:"model"`
	Stream   bool          `json:"stream"`
	Messages []chatMessage `json:"messages"`
	Tools    []struct {
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	} `json:"tools"`
}

// text flattens a message content: a string, or a list of parts with text.
func text(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	_ = json.Unmarshal(raw, &parts)
	var b strings.Builder
	for _, p := range parts {
		b.WriteString(p.Text)
	}
	return b.String()
}

var workdirRE = regexp.MustCompile(`Working directory: (\S+)`)

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
		Stream: req.Stream, Time: time.Now()}
	for _, t := range req.Tools {
		rec.Tools = append(rec.Tools, t.Function.Name)
	}
	workdir := ""
	rec.Messages = len(req.Messages)
	if n := len(req.Messages); n > 0 {
		rec.LastRole, rec.LastText = req.Messages[n-1].Role, text(req.Messages[n-1].Content)
		if m := workdirRE.FindStringSubmatch(text(req.Messages[0].Content)); m != nil {
			workdir = m[1]
		}
	}
	s.mu.Lock()
	s.requests = append(s.requests, rec)
	close(s.notify)
	s.notify = make(chan struct{})
	s.mu.Unlock()

	rep := s.script(rec, workdir)
	if !req.Stream {
		writeJSON(w, req.Model, rep)
		return
	}
	s.stream(w, r, req.Model, rep)
}

// reply is one scripted answer: text chunks, or a tool call.
type reply struct {
	chunks   []string
	toolName string
	toolArgs string
	slow     bool
}

func (s *Server) script(rec Request, workdir string) reply {
	last := strings.ToLower(rec.LastText)
	switch {
	case len(rec.Tools) == 0 && rec.Stream:
		return reply{chunks: []string{Title}}
	case rec.LastRole == "tool":
		return reply{chunks: []string{"Created ", "hello.txt ", "in the workspace."}}
	case rec.LastRole == "user" && strings.Contains(last, "create hello.txt") && hasTool(rec.Tools, WriteTool):
		file := "hello.txt"
		if workdir != "" {
			file = path.Join(workdir, file)
		}
		args, _ := json.Marshal(map[string]string{"filePath": file, "content": FileContent})
		return reply{chunks: []string{"I'll create the file."}, toolName: WriteTool, toolArgs: string(args)}
	case strings.Contains(last, "slow"):
		return reply{chunks: []string{SlowFirstBit}, slow: true}
	}
	return reply{chunks: []string{"Hello ", "from the ", "fake model."}}
}

func hasTool(tools []string, name string) bool {
	for _, t := range tools {
		if t == name {
			return true
		}
	}
	return false
}

func writeJSON(w http.ResponseWriter, model string, rep reply) {
	msg := map[string]any{"role": "assistant", "content": strings.Join(rep.chunks, "")}
	finish := "stop"
	if rep.toolName != "" {
		msg["tool_calls"] = []map[string]any{{"id": "call_1", "type": "function",
			"function": map[string]any{"name": rep.toolName, "arguments": rep.toolArgs}}}
		finish = "tool_calls"
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"id": "chatcmpl-fake", "object": "chat.completion", "created": time.Now().Unix(), "model": model,
		"choices": []map[string]any{{"index": 0, "message": msg, "finish_reason": finish}},
		"usage":   map[string]int{"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
	})
}

func (s *Server) stream(w http.ResponseWriter, r *http.Request, model string, rep reply) {
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
			return
		case <-time.After(s.Hold):
		}
	}
	finish := "stop"
	if rep.toolName != "" {
		send(map[string]any{"tool_calls": []map[string]any{{"index": 0, "id": "call_1", "type": "function",
			"function": map[string]any{"name": rep.toolName, "arguments": rep.toolArgs}}}}, nil)
		finish = "tool_calls"
	}
	send(map[string]any{}, finish)
	usage, _ := json.Marshal(map[string]any{"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created, "model": model,
		"choices": []any{}, "usage": map[string]int{"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
	fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", usage)
	if flusher != nil {
		flusher.Flush()
	}
}
