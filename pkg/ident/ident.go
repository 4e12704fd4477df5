// Package ident is the syntax of the ids and worktree directories every
// agentplane API accepts, public and internal alike: an internal caller
// (or anyone holding the internal token) must not get a value past a
// service that the public API would refuse ("s/..", "..", "../x").
package ident

import (
	"fmt"
	"path"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Limits.
const (
	MaxIDLen        = 64
	MaxDirectoryLen = 4096
)

// ID returns what is wrong with an id (session, sandbox, runtime session,
// user, org, message, credential reference), or "": 1 to 64 of
// [a-zA-Z0-9_-]. No '.', '/', ':' or braces, so an id is never a path
// segment like "..", never splits a key and never breaks a Redis hash tag.
func ID(v string) string {
	if v == "" {
		return "required"
	}
	if len(v) > MaxIDLen {
		return fmt.Sprintf("at most %d characters", MaxIDLen)
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return "only letters, digits, '_' and '-' are allowed"
		}
	}
	return ""
}

// OptionalID is ID for an id that may be empty.
func OptionalID(v string) string {
	if v == "" {
		return ""
	}
	return ID(v)
}

// Directory returns what is wrong with a worktree directory, or "":
// absolute, already normalized (no "..", ".", "//" or trailing slash), not
// the root, printable UTF-8 without backslashes.
func Directory(v string) string {
	switch {
	case v == "":
		return "required"
	case len(v) > MaxDirectoryLen:
		return fmt.Sprintf("at most %d bytes", MaxDirectoryLen)
	case !utf8.ValidString(v):
		return "must be valid UTF-8"
	case strings.ContainsFunc(v, func(r rune) bool { return unicode.IsControl(r) || r == '\\' }):
		return "must not contain control characters or backslashes"
	case !strings.HasPrefix(v, "/"):
		return "must be an absolute path"
	case path.Clean(v) != v:
		return "must be normalized (no '..', '.', '//' or trailing '/')"
	case v == "/":
		return "must not be the root directory"
	}
	return ""
}
