package history

import "encoding/binary"

// validJSON reports whether b is one JSON value, accepting exactly what encoding/json.Valid
// accepts (the fuzz target FuzzValidJSON checks the equivalence), including its nesting
// limit and its tolerance of invalid UTF-8 inside strings. It exists because json.Valid
// steps a state machine through a function call per byte, which made validation the
// largest cost of ingesting 1 KiB items; this scans string contents in a tight loop.
func validJSON(b []byte) bool {
	const maxDepth = 10000 // encoding/json's maxNestingDepth
	var stack []byte       // open containers: '{' or '['
	i := skipSpace(b, 0)
	for {
		// A value starts at i.
		if i >= len(b) {
			return false
		}
		switch c := b[i]; c {
		case '{', '[':
			if len(stack) >= maxDepth {
				return false
			}
			i = skipSpace(b, i+1)
			if i < len(b) && ((c == '{' && b[i] == '}') || (c == '[' && b[i] == ']')) {
				i++
				break // an empty container is a complete value
			}
			stack = append(stack, c)
			if c == '{' {
				var ok bool
				if i, ok = objectKey(b, i); !ok {
					return false
				}
			}
			continue // its first value
		case '"':
			var ok bool
			if i, ok = scanString(b, i); !ok {
				return false
			}
		case 't':
			if !hasLiteral(b, i, "true") {
				return false
			}
			i += 4
		case 'f':
			if !hasLiteral(b, i, "false") {
				return false
			}
			i += 5
		case 'n':
			if !hasLiteral(b, i, "null") {
				return false
			}
			i += 4
		default:
			var ok bool
			if i, ok = scanNumber(b, i); !ok {
				return false
			}
		}
		// A value ended at i: close containers until one wants another value.
		for {
			i = skipSpace(b, i)
			if len(stack) == 0 {
				return i == len(b)
			}
			if i >= len(b) {
				return false
			}
			top := stack[len(stack)-1]
			switch {
			case b[i] == ',':
				i = skipSpace(b, i+1)
				if top == '{' {
					var ok bool
					if i, ok = objectKey(b, i); !ok {
						return false
					}
				}
			case (top == '{' && b[i] == '}') || (top == '[' && b[i] == ']'):
				stack = stack[:len(stack)-1]
				i++
				continue
			default:
				return false
			}
			break
		}
	}
}

// objectKey scans `"key" :` and the space after it; i is at the key.
func objectKey(b []byte, i int) (int, bool) {
	if i >= len(b) || b[i] != '"' {
		return i, false
	}
	i, ok := scanString(b, i)
	if !ok {
		return i, false
	}
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != ':' {
		return i, false
	}
	return skipSpace(b, i+1), true
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

func hasLiteral(b []byte, i int, lit string) bool {
	return len(b)-i >= len(lit) && string(b[i:i+len(lit)]) == lit
}

// scanString scans a string starting at the quote at i and returns the index after it.
// Eight bytes at a time while none of them is a quote, a backslash or a control character
// (the bulk of a typical payload), then byte by byte.
func scanString(b []byte, i int) (int, bool) {
	i++
	for i < len(b) {
		for len(b)-i >= 8 && !specialInWord(binary.LittleEndian.Uint64(b[i:])) {
			i += 8
		}
		if i >= len(b) {
			break
		}
		c := b[i]
		switch {
		case c == '"':
			return i + 1, true
		case c < 0x20:
			return i, false
		case c == '\\':
			if i+1 >= len(b) {
				return i, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if len(b)-i < 6 {
					return i, false
				}
				for _, h := range b[i+2 : i+6] {
					if !isHex(h) {
						return i, false
					}
				}
				i += 6
			default:
				return i, false
			}
		default:
			i++
		}
	}
	return i, false
}

// specialInWord reports whether any of the eight bytes of w is '"', '\\' or below 0x20
// (bit tricks from "Bit Twiddling Hacks": hasZero is exact about whether some byte is zero,
// hasLess about whether some byte is below n ≤ 128).
func specialInWord(w uint64) bool {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	hasZero := func(x uint64) bool { return (x-ones)&^x&highs != 0 }
	hasLess := func(x uint64, n uint64) bool { return (x-ones*n)&^x&highs != 0 }
	return hasZero(w^(ones*'"')) || hasZero(w^(ones*'\\')) || hasLess(w, 0x20)
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// scanNumber scans -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? at i.
func scanNumber(b []byte, i int) (int, bool) {
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		i = skipDigits(b, i+1)
	default:
		return i, false
	}
	if i < len(b) && b[i] == '.' {
		j := skipDigits(b, i+1)
		if j == i+1 {
			return i, false
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := skipDigits(b, i)
		if j == i {
			return i, false
		}
		i = j
	}
	return i, true
}

func skipDigits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}
