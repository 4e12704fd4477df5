// Package usage reads the token usage an OpenAI-compatible provider
// reports in its responses, as the bytes stream through the credential
// proxy: a JSON body (chat completions, responses, embeddings) or an event
// stream (its last event that carries usage). It never buffers a body: it
// looks at each byte once and keeps a bounded state, so a huge or hostile
// response costs it no memory. It also says how to ask a streamed chat
// completion for its usage (stream_options.include_usage). Pure: no I/O.
package usage

import (
	"mime"
	"strconv"
	"strings"
)

// Usage is what one response reported.
type Usage struct {
	// Model is the model the response names (bounded; "" when none).
	Model string
	// Input, Output and Cached are prompt, completion and cached prompt
	// tokens (cached is part of input).
	Input, Output, Cached uint64
	// Found: the response carried a usage object with at least one count.
	Found bool
}

// Format is how a response body is read.
type Format uint8

const (
	// None: the body carries no usage the reader understands.
	None Format = iota
	// JSON: one JSON value.
	JSON
	// SSE: a text/event-stream whose events' data are JSON values.
	SSE
)

// FormatOf picks the format from a response's Content-Type.
func FormatOf(contentType string) Format {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return None
	}
	switch {
	case mt == "text/event-stream":
		return SSE
	case mt == "application/json" || strings.HasSuffix(mt, "+json"):
		return JSON
	}
	return None
}

// Reader reads a response body's usage from its bytes in any split.
type Reader struct {
	format Format
	scan   jsonScan
	// ev is the usage of the JSON value being read (an event's, in a
	// stream); got is the last complete value's that had usage.
	ev, got Usage
	model   string

	// Event stream line state.
	line   lineState
	field  int  // bytes of "data:" matched at the start of the line
	lastCR bool // the last byte was "\r"
	inData bool // the event has data lines
}

type lineState uint8

const (
	lineStart lineState = iota // at the start of a line
	lineField                  // matching "data:"
	lineData                   // in a data line's value
	lineSkip                   // in another field or a comment
)

// NewReader reads a body of format f.
func NewReader(f Format) *Reader {
	r := &Reader{format: f}
	r.scan.on = r.value
	return r
}

// Write feeds body bytes; it never fails (what is not understood is not
// counted).
func (r *Reader) Write(p []byte) (int, error) {
	switch r.format {
	case JSON:
		r.scan.write(p)
	case SSE:
		r.sse(p)
	}
	return len(p), nil
}

// Done reports whether the usage is complete before the body ended: the
// JSON value was read whole, or an event of the stream carried usage.
func (r *Reader) Done() bool {
	switch r.format {
	case JSON:
		return r.scan.done && !r.scan.fail
	case SSE:
		return r.got.Found
	}
	return false
}

// Usage is what the body reported once it ended (after its last Write), or
// once Done.
func (r *Reader) Usage() Usage {
	switch r.format {
	case JSON:
		r.endValue()
	case SSE:
		r.endEvent() // a stream cut without its final blank line
	}
	u := r.got
	if u.Model == "" {
		u.Model = r.model
	}
	return u
}

var dataField, newline = []byte("data:"), []byte("\n")

func (r *Reader) sse(p []byte) {
	for i := 0; i < len(p); i++ {
		c := p[i]
		if c == '\n' && r.lastCR { // "\r\n" is one line end
			r.lastCR = false
			continue
		}
		r.lastCR = c == '\r'
		if c == '\n' || c == '\r' {
			switch r.line {
			case lineStart: // an empty line ends the event
				r.endEvent()
			case lineData: // data lines of one event join with "\n"
				r.scan.write(newline)
			}
			r.line, r.field = lineStart, 0
			continue
		}
		switch r.line {
		case lineStart, lineField:
			if c != dataField[r.field] {
				r.line = lineSkip // another field, or a comment
				continue
			}
			r.field++
			r.line = lineField
			if r.field == len(dataField) {
				// The value follows (one space after the colon is not
				// part of it; JSON ignores it anyway).
				r.line, r.inData = lineData, true
			}
		case lineData: // feed the rest of the line at once
			j := i
			for j < len(p) && p[j] != '\n' && p[j] != '\r' {
				j++
			}
			r.scan.write(p[i:j])
			i = j - 1
		}
	}
}

// endEvent ends an event: its data is one JSON value (or not JSON, such as
// "[DONE]", and ignored).
func (r *Reader) endEvent() {
	if r.inData {
		r.endValue()
	}
	r.inData = false
}

func (r *Reader) endValue() {
	if r.scan.finish() && r.ev.Found {
		r.got = r.ev
	}
	r.ev = Usage{}
	r.scan.reset()
}

// value takes the values the reader looks for: the model and the usage
// counts, at the top level or under "response" (the Responses API's
// stream events).
func (r *Reader) value(path []string, kind byte, raw []byte, _ int64) {
	if len(path) > 0 && path[0] == "response" {
		path = path[1:]
	}
	switch {
	case len(path) == 1 && path[0] == "model" && kind == kindString:
		if r.model != "" && string(raw) == r.model { // every chunk names it: keep the string
			r.ev.Model = r.model
		} else if m := cleanModel(raw); m != "" {
			r.ev.Model, r.model = m, m
		}
	case len(path) == 2 && path[0] == "usage" && kind == kindLiteral:
		n, ok := count(raw)
		if !ok {
			return
		}
		switch path[1] {
		case "prompt_tokens", "input_tokens":
			r.ev.Input, r.ev.Found = n, true
		case "completion_tokens", "output_tokens":
			r.ev.Output, r.ev.Found = n, true
		}
	case len(path) == 3 && path[0] == "usage" && kind == kindLiteral && path[2] == "cached_tokens" &&
		(path[1] == "prompt_tokens_details" || path[1] == "input_tokens_details"):
		if n, ok := count(raw); ok {
			r.ev.Cached, r.ev.Found = n, true
		}
	}
}

// maxCount bounds a token count: more is not a real response's.
const maxCount = 1 << 40

func count(raw []byte) (uint64, bool) {
	n, err := strconv.ParseUint(string(raw), 10, 64)
	if err != nil || n > maxCount {
		return 0, false
	}
	return n, true
}

// MaxModel bounds a model name.
const MaxModel = 96

// cleanModel keeps a model name that is a plausible identifier (letters,
// digits and . _ - : / @ +), at most MaxModel bytes: it becomes a metric
// label and is shown to callers.
func cleanModel(raw []byte) string {
	if len(raw) == 0 || len(raw) > MaxModel {
		return ""
	}
	for _, c := range raw {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '.' || c == '_' || c == '-' || c == ':' || c == '/' || c == '@' || c == '+'
		if !ok {
			return ""
		}
	}
	return string(raw)
}
