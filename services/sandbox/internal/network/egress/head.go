package egress

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
)

// Request head bounds, like the credential proxy's: a runtime's request line
// past MaxRequestLine is answered 414, a header block past
// MaxRequestHeaders fields or MaxRequestHeaderBytes bytes 431, each before
// more than the bound (plus one read-ahead buffer) was read, so a head of
// any size costs the service a few KiB per connection.
const (
	MaxRequestLine        = 8 << 10
	MaxRequestHeaders     = 100
	MaxRequestHeaderBytes = 32 << 10
)

// headLimit passes reads through; while on, it ends the stream once left
// bytes were read (what the head may use plus the reader's read-ahead).
type headLimit struct {
	r        io.Reader
	on       bool
	left     int
	exceeded bool
}

func (l *headLimit) Read(p []byte) (int, error) {
	if !l.on {
		return l.r.Read(p)
	}
	if l.left <= 0 {
		l.exceeded = true
		return 0, io.ErrUnexpectedEOF
	}
	if len(p) > l.left {
		p = p[:l.left]
	}
	n, err := l.r.Read(p)
	l.left -= n
	return n, err
}

// headReader is what a request is read from: a buffered reader whose
// underlying reads stop at the head bound until the head was read.
type headReader struct {
	*bufio.Reader
	limit *headLimit
}

func newHeadReader(r io.Reader) headReader {
	l := &headLimit{r: r, on: true, left: MaxRequestLine + MaxRequestHeaderBytes + MaxRequestLine}
	return headReader{Reader: bufio.NewReaderSize(l, MaxRequestLine), limit: l}
}

// lineTooLong reports whether the request line is longer than the buffer
// (MaxRequestLine) without consuming anything; a read error is left for
// the parser to report.
func (h headReader) lineTooLong() bool {
	for {
		n := h.Buffered()
		b, _ := h.Peek(n)
		if bytes.IndexByte(b, '\n') >= 0 {
			return false
		}
		if n >= MaxRequestLine {
			return true
		}
		if _, err := h.Peek(n + 1); err != nil {
			return false
		}
	}
}

// readHead reads one request head within the bounds. On a refusal req is
// nil and code is 414 or 431; on a malformed or cut head both are zero.
func (h headReader) readHead() (req *http.Request, code int, reason string) {
	if h.lineTooLong() {
		return nil, http.StatusRequestURITooLong, ReasonRequestLineTooLong
	}
	req, err := http.ReadRequest(h.Reader)
	if h.limit.exceeded {
		return nil, http.StatusRequestHeaderFieldsTooLarge, ReasonHeadersTooLarge
	}
	if err != nil {
		return nil, 0, ReasonBadRequest
	}
	fields, size := 0, 0
	for k, vs := range req.Header {
		for _, v := range vs {
			fields++
			size += len(k) + len(v) + 4
		}
	}
	if fields > MaxRequestHeaders || size > MaxRequestHeaderBytes {
		return nil, http.StatusRequestHeaderFieldsTooLarge, ReasonHeadersTooLarge
	}
	h.limit.on = false // the body or tunnel flows unbounded by the head's bound
	return req, 0, ""
}
