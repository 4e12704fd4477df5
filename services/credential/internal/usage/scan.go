package usage

// jsonScan is a push tokenizer for one JSON value: it is fed any split of
// the bytes and calls back each scalar value (and each container's start)
// with the object keys leading to it. It keeps no more than a bounded stack
// and a bounded capture of the value it reports: a huge or hostile body
// costs time in proportion to its size and never memory.
type jsonScan struct {
	on func(path []string, kind byte, raw []byte, pos int64)

	st    scanState
	stack []byte // 'o' or 'a' per open container
	keys  [maxKeyDepth]string
	// cap holds the string or literal being read, up to maxCapture bytes;
	// over marks one that did not fit (reported as nothing).
	cap   []byte
	over  bool
	isKey bool
	hex   int   // hex digits left in a \u escape
	start int64 // offset of the value being read
	pos   int64 // offset of the next byte
	done  bool  // one complete top-level value was read
	fail  bool  // not JSON: nothing more is reported
}

type scanState uint8

const (
	sValue      scanState = iota // a value is expected
	sFirstKey                    // after '{': a key or '}'
	sKey                         // after ',' in an object: a key
	sColon                       // after a key
	sAfter                       // after a value: ',' or a closing bracket
	sFirstValue                  // after '[': a value or ']'
	sString                      // in a string
	sEscape                      // after a backslash in a string
	sLiteral                     // in a number, true, false or null
	sUnicode                     // in the 4 hex digits of a \u escape
)

const (
	// maxDepth bounds the nesting the scanner follows; deeper is not JSON
	// an OpenAI-compatible API sends.
	maxDepth = 128
	// maxKeyDepth is the deepest value whose path is reported in full;
	// what the reader looks for is at most four keys down.
	maxKeyDepth = 4
	// maxCapture bounds a captured key, string or literal.
	maxCapture = 128
)

// Value kinds reported to on.
const (
	kindString  = 's'
	kindLiteral = 'l' // number, true, false, null
	kindObject  = '{'
	kindArray   = '['
)

// noKey stands for an array element or a key that was not kept.
const noKey = "\x00"

func (s *jsonScan) reset() {
	s.st, s.stack, s.cap, s.over, s.isKey, s.done, s.fail = sValue, s.stack[:0], s.cap[:0], false, false, false, false
}

// path is the keys leading to a value at the current depth, or nil when it
// is deeper than maxKeyDepth.
func (s *jsonScan) path() []string {
	if len(s.stack) > maxKeyDepth {
		return nil
	}
	return s.keys[:len(s.stack)]
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// write feeds p.
func (s *jsonScan) write(p []byte) {
	for i := 0; i < len(p) && !s.fail; i++ {
		s.byte(p[i])
		s.pos++
	}
}

func (s *jsonScan) byte(c byte) {
	switch s.st {
	case sString, sEscape, sUnicode:
		s.stringByte(c)
		return
	case sLiteral:
		if c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c == '.' || c == '+' || c == '-' || c == 'E' {
			s.capture(c)
			return
		}
		s.endValue(kindLiteral)
		s.st = sAfter
		// c is the byte after the literal: read it as such.
	}
	if isSpace(c) {
		return
	}
	if s.done {
		s.fail = true // bytes after the top-level value
		return
	}
	switch s.st {
	case sValue, sFirstValue:
		s.valueStart(c)
	case sFirstKey, sKey:
		switch {
		case c == '"':
			s.begin(true)
		case c == '}' && s.st == sFirstKey:
			s.close('o')
		default:
			s.fail = true
		}
	case sColon:
		if c != ':' {
			s.fail = true
			return
		}
		s.st = sValue
	case sAfter:
		s.afterValue(c)
	}
}

// stringByte reads a byte of a string (its escapes checked as JSON's).
func (s *jsonScan) stringByte(c byte) {
	switch s.st {
	case sString:
		switch {
		case c == '"':
			s.endString()
			return
		case c == '\\':
			s.st = sEscape
		case c < 0x20:
			s.fail = true
			return
		}
	case sEscape:
		switch c {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			s.st = sString
		case 'u':
			s.st, s.hex = sUnicode, 4
		default:
			s.fail = true
			return
		}
	case sUnicode:
		if !isHex(c) {
			s.fail = true
			return
		}
		if s.hex--; s.hex == 0 {
			s.st = sString
		}
	}
	s.capture(c)
}

// valueStart reads the first byte of a value (or the ']' of an empty array).
func (s *jsonScan) valueStart(c byte) {
	switch {
	case c == ']' && s.st == sFirstValue:
		s.close('a')
	case c == '{' || c == '[':
		kind := byte(kindObject)
		if c == '[' {
			kind = kindArray
		}
		s.start = s.pos
		s.emit(kind, nil)
		if len(s.stack) >= maxDepth {
			s.fail = true
			return
		}
		if c == '{' {
			s.stack = append(s.stack, 'o')
			s.st = sFirstKey
		} else {
			s.stack = append(s.stack, 'a')
			s.setKey(noKey)
			s.st = sFirstValue
		}
	case c == '"':
		s.begin(false)
	case c == '-' || c >= '0' && c <= '9' || c == 't' || c == 'f' || c == 'n':
		s.start, s.cap, s.over = s.pos, s.cap[:0], false
		s.capture(c)
		s.st = sLiteral
	default:
		s.fail = true
	}
}

// afterValue reads what follows a value: a comma or a closing bracket.
func (s *jsonScan) afterValue(c byte) {
	switch {
	case c == ',' && len(s.stack) > 0:
		if s.stack[len(s.stack)-1] == 'o' {
			s.st = sKey
		} else {
			s.st = sValue
		}
	case c == '}':
		s.close('o')
	case c == ']':
		s.close('a')
	default:
		s.fail = true
	}
}

func (s *jsonScan) begin(key bool) {
	s.start, s.cap, s.over, s.isKey = s.pos, s.cap[:0], false, key
	s.st = sString
}

func (s *jsonScan) capture(c byte) {
	if len(s.cap) >= maxCapture {
		s.over = true
		return
	}
	s.cap = append(s.cap, c)
}

func (s *jsonScan) endString() {
	if s.isKey {
		k := noKey
		if !s.over {
			k = knownKey(s.cap)
		}
		s.setKey(k)
		s.st = sColon
		return
	}
	s.endValue(kindString)
	s.st = sAfter
}

// setKey names the current value of the innermost container.
func (s *jsonScan) setKey(k string) {
	if d := len(s.stack); d > 0 && d <= maxKeyDepth {
		s.keys[d-1] = k
	}
}

func (s *jsonScan) endValue(kind byte) {
	if kind == kindLiteral && (s.over || !validLiteral(s.cap)) {
		s.fail = true // a literal longer than any an API sends is refused, not skipped
		return
	}
	if !s.over {
		s.emit(kind, s.cap)
	}
	if len(s.stack) == 0 {
		s.done = true
	}
}

func (s *jsonScan) emit(kind byte, raw []byte) {
	if s.on != nil {
		if p := s.path(); p != nil {
			s.on(p, kind, raw, s.start)
		}
	}
}

func (s *jsonScan) close(want byte) {
	if len(s.stack) == 0 || s.stack[len(s.stack)-1] != want {
		s.fail = true
		return
	}
	s.stack = s.stack[:len(s.stack)-1]
	s.st = sAfter
	if len(s.stack) == 0 {
		s.done = true
	}
}

// finish ends the input: a literal at the very end (a bare top-level
// number) is complete now. It reports whether one whole value was read.
func (s *jsonScan) finish() bool {
	if s.fail {
		return false
	}
	if s.st == sLiteral {
		s.endValue(kindLiteral)
		s.st = sAfter
	}
	return s.done
}

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// validLiteral: true, false, null or a JSON number.
func validLiteral(b []byte) bool {
	switch string(b) {
	case "true", "false", "null":
		return true
	}
	i := 0
	digits := func() int {
		n := 0
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i, n = i+1, n+1
		}
		return n
	}
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case digits() == 0:
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		if digits() == 0 {
			return false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if digits() == 0 {
			return false
		}
	}
	return i == len(b)
}

// knownKey is the key the readers of this package look for, as a constant
// (comparing a []byte in a string switch allocates nothing: a stream of
// small events would otherwise cost one string per key), or noKey.
func knownKey(b []byte) string {
	switch string(b) {
	case "model":
		return "model"
	case "usage":
		return "usage"
	case "response":
		return "response"
	case "prompt_tokens":
		return "prompt_tokens"
	case "input_tokens":
		return "input_tokens"
	case "completion_tokens":
		return "completion_tokens"
	case "output_tokens":
		return "output_tokens"
	case "prompt_tokens_details":
		return "prompt_tokens_details"
	case "input_tokens_details":
		return "input_tokens_details"
	case "cached_tokens":
		return "cached_tokens"
	case "stream":
		return "stream"
	case "stream_options":
		return "stream_options"
	}
	return noKey
}
