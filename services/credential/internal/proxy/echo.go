package proxy

import (
	"bytes"
	"errors"
	"net/http"
	"strings"
)

// What an upstream echoes back must not hand the runtime the backing
// credential or the attestation the proxy added (a TRACE answer, a debug
// endpoint, an error message quoting the request). The rule (docs/
// credential.md, "What the proxy returns"):
//
//   - a response or trailer header whose value holds either verbatim:
//     the response is refused (502) before any of it is sent, or the
//     trailer is dropped;
//   - a body: each verbatim occurrence is overwritten with '*' of the same
//     length as it streams through (the length, Content-Length and the
//     event stream stay intact); the bytes that could be the start of one
//     are held back until the next read shows they are not;
//   - a body the proxy cannot read (Content-Encoding other than identity;
//     the proxy never forwards Accept-Encoding, so an upstream that
//     compresses anyway): refused (502).
//
// Only verbatim copies are caught; an upstream that transforms a
// credential (hashes, masks, encodes it) is trusted with it anyway.

// errEchoed: an upstream response header held a credential.
var errEchoed = errors.New("upstream response echoed a credential")

// errEncoded: an upstream body the proxy cannot inspect.
var errEncoded = errors.New("upstream response body is encoded")

// echoGuard holds the values that must not reach the caller.
type echoGuard struct{ needles [][]byte }

func newEchoGuard(values ...string) echoGuard {
	var g echoGuard
	for _, v := range values {
		if strings.Trim(v, "*") != "" { // all-'*' would match its own mask forever
			g.needles = append(g.needles, []byte(v))
		}
	}
	return g
}

// inHeader reports whether any value of h holds a needle.
func (g echoGuard) inHeader(h http.Header) bool {
	for k, vs := range h {
		for _, n := range g.needles {
			if strings.Contains(k, string(n)) {
				return true
			}
			for _, v := range vs {
				if strings.Contains(v, string(n)) {
					return true
				}
			}
		}
	}
	return false
}

// scrubber masks needles in a byte stream split into arbitrary chunks.
type scrubber struct {
	g       echoGuard
	pending []byte // held back: could be the start of a needle
	buf     []byte
}

// next returns the part of pending+p that is safe to send, with every
// complete needle masked; it keeps the rest, unless last (the end of the
// stream: no needle completes after it). It may mask p in place; the
// result is valid until the next call.
func (s *scrubber) next(p []byte, last bool) []byte {
	if len(s.g.needles) == 0 {
		return p
	}
	b := p // usually nothing is held back: work in the caller's buffer, copy nothing
	if len(s.pending) > 0 {
		s.buf = append(append(s.buf[:0], s.pending...), p...)
		b = s.buf
	}
	mask(b, s.g.needles)
	hold := 0
	if !last {
		hold = heldBack(b, s.g.needles)
	}
	s.pending = append(s.pending[:0], b[len(b)-hold:]...)
	return b[:len(b)-hold]
}

// mask overwrites every occurrence of each needle in b with '*'. Each
// overwrite turns at least one byte of b that was not '*' into '*' (a
// needle is never all '*'), so the loop ends.
func mask(b []byte, needles [][]byte) {
	for again := true; again; {
		again = false
		for _, n := range needles {
			for i := bytes.Index(b, n); i >= 0; i = bytes.Index(b, n) {
				for j := i; j < i+len(n); j++ {
					b[j] = '*'
				}
				again = true
			}
		}
	}
}

// heldBack is the length of the longest suffix of b that is a proper
// prefix of a needle: a needle could still complete there.
func heldBack(b []byte, needles [][]byte) int {
	hold := 0
	for _, n := range needles {
		from := max(0, len(b)-(len(n)-1))
		for i := from; i < len(b) && len(b)-i > hold; i++ {
			if b[i] == n[0] && bytes.HasPrefix(n, b[i:]) {
				hold = len(b) - i
				break
			}
		}
	}
	return hold
}
