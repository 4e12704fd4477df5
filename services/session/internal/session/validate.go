package session

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"agentplane.dev/pkg/ident"
	"agentplane.dev/pkg/paging"
)

// Limits of outside input.
const (
	MaxIDLen        = ident.MaxIDLen
	MaxContentBytes = 256 << 10
	MaxDirectoryLen = ident.MaxDirectoryLen
	MaxRepoURLLen   = 2048
	MaxLabels       = 16
	MaxLabelLen     = 63
	MaxSecretBytes  = 16 << 10
	MaxPageSize     = paging.MaxPageSize
)

// CheckID checks a client- or server-chosen id: 1 to 64 of [a-zA-Z0-9_-]
// (pkg/ident, the rule of every API).
func CheckID(field, v string) []Violation { return violation(field, ident.ID(v)) }

// CheckOptionalID is CheckID for an id that may be empty.
func CheckOptionalID(field, v string) []Violation { return violation(field, ident.OptionalID(v)) }

// CheckDirectory checks a worktree directory: absolute, already normalized
// (no "..", ".", "//" or trailing slash), printable UTF-8 (pkg/ident).
func CheckDirectory(field, v string) []Violation { return violation(field, ident.Directory(v)) }

func violation(field, desc string) []Violation {
	if desc == "" {
		return nil
	}
	return []Violation{{field, desc}}
}

// CheckContent checks message text: 1 byte to 256 KiB of UTF-8.
func CheckContent(field, v string) []Violation {
	switch {
	case v == "":
		return []Violation{{field, "required"}}
	case len(v) > MaxContentBytes:
		return []Violation{{field, fmt.Sprintf("at most %d bytes", MaxContentBytes)}}
	case !utf8.ValidString(v):
		return []Violation{{field, "must be valid UTF-8"}}
	}
	return nil
}

// CheckRepoURL checks the optional informational repository URL.
func CheckRepoURL(field, v string) []Violation {
	switch {
	case len(v) > MaxRepoURLLen:
		return []Violation{{field, fmt.Sprintf("at most %d bytes", MaxRepoURLLen)}}
	case !utf8.ValidString(v) || strings.ContainsFunc(v, unicode.IsControl):
		return []Violation{{field, "must be printable UTF-8"}}
	}
	return nil
}

// CheckSecret checks the backing secret without ever echoing it.
func CheckSecret(field, v string) []Violation {
	switch {
	case v == "":
		return []Violation{{field, "required"}}
	case len(v) > MaxSecretBytes:
		return []Violation{{field, fmt.Sprintf("at most %d bytes", MaxSecretBytes)}}
	case strings.ContainsFunc(v, unicode.IsControl) || !utf8.ValidString(v):
		return []Violation{{field, "must be printable UTF-8"}}
	}
	return nil
}

// CheckLabels checks caller labels: at most 16, keys 1 to 63 bytes and
// values at most 63 bytes of printable UTF-8.
func CheckLabels(field string, labels map[string]string) []Violation {
	if len(labels) > MaxLabels {
		return []Violation{{field, fmt.Sprintf("at most %d labels", MaxLabels)}}
	}
	var vs []Violation
	bad := func(s string) bool { return !utf8.ValidString(s) || strings.ContainsFunc(s, unicode.IsControl) }
	for k, v := range labels {
		switch {
		case k == "" || len(k) > MaxLabelLen || bad(k):
			vs = append(vs, Violation{field, "keys must be 1 to 63 bytes of printable UTF-8"})
		case len(v) > MaxLabelLen || bad(v):
			vs = append(vs, Violation{field + "[" + k + "]", "values must be at most 63 bytes of printable UTF-8"})
		}
	}
	return vs
}

// CheckPageSize checks a page size (0 means the default): the rule every
// list call of every service shares (pkg/paging).
func CheckPageSize(field string, n int32) []Violation {
	if d := paging.Check(n); d != "" {
		return []Violation{{field, d}}
	}
	return nil
}
