package usage

// Request is what the reader needs from a chat completion request.
type Request struct {
	// Model the request names ("" when none or not a plausible name).
	Model string
	// Stream: "stream": true.
	Stream bool
	// StreamOptions: the caller set "stream_options" (to anything).
	StreamOptions bool
	// open is the offset of the top-level object's '{' (-1: not an object).
	open int64
}

// ParseRequest reads a request body (the whole of it).
func ParseRequest(body []byte) Request {
	req := Request{open: -1}
	s := jsonScan{on: func(path []string, kind byte, raw []byte, pos int64) {
		switch {
		case len(path) == 0 && kind == kindObject:
			req.open = pos
		case len(path) != 1:
		case path[0] == "model" && kind == kindString:
			req.Model = cleanModel(raw)
		case path[0] == "stream":
			req.Stream = kind == kindLiteral && string(raw) == "true"
		case path[0] == "stream_options":
			req.StreamOptions = true
		}
	}}
	s.write(body)
	if !s.finish() {
		return Request{open: -1}
	}
	return req
}

// includeUsage is the member added to a streamed request's top level.
var includeUsage = []byte(`"stream_options":{"include_usage":true},`)

// AskForUsage returns the body of a streamed chat completion that does not
// say whether it wants usage with "stream_options":{"include_usage":true}
// added as its first member, and true; otherwise body and false. Nothing
// else of the body changes (no re-encoding: key order, numbers and spacing
// stay as the caller sent them). A caller that set stream_options keeps
// its choice.
func AskForUsage(body []byte, req Request) ([]byte, bool) {
	if !req.Stream || req.StreamOptions || req.open < 0 || req.open >= int64(len(body)) {
		return body, false
	}
	at := req.open + 1
	out := make([]byte, 0, len(body)+len(includeUsage))
	out = append(append(append(out, body[:at]...), includeUsage...), body[at:]...)
	return out, true
}

// IsChatCompletions reports whether an upstream path (the segments after
// the route) is a chat completion: its streams report usage only when
// asked.
func IsChatCompletions(rest []string) bool {
	n := len(rest)
	return n >= 2 && rest[n-2] == "chat" && rest[n-1] == "completions"
}
