// Package history is the domain of runtime-session history: typed, versioned items, the
// limits a batch must respect, and the errors the service speaks in. It does no I/O.
package history

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"agentplane.dev/pkg/ident"
)

// Limits of DESIGN.md section 6.
const (
	MaxItemPayloadBytes = 2 << 20 // one item's JSON payload
	MaxBatchItems       = 128
	MaxBatchBytes       = 4 << 20 // sum of the items' payloads in one batch
	MaxIDLength         = 128     // item ids, parent ids and runtime session ids
)

// Type is the kind of a history item. The values equal the protobuf enum's.
type Type int32

// The known item types; anything else is rejected.
const (
	TypeUnspecified Type = iota
	TypeSession
	TypeMessage
	TypePart
	TypeDiff
	TypeStatus
	TypeOpen
	TypeClose
	TypeNotification
	typeEnd // first unknown value
)

// Known reports whether t is a type items may have.
func (t Type) Known() bool { return t > TypeUnspecified && t < typeEnd }

// Item is one version of one history item.
type Item struct {
	ID       string
	Type     Type
	Version  uint64 // ≥ 1; an older version never overwrites a newer one
	ParentID string // optional
	Payload  []byte // JSON, ≤ MaxItemPayloadBytes
	Time     time.Time
}

// Entry is an item version as stored in a runtime session's stream, with its cursor.
type Entry struct {
	Item   Item
	Cursor string
}

// Domain errors; grpcapi translates them.
var (
	// ErrNotFound: the runtime session was never created or ingested into.
	ErrNotFound = errors.New("runtime session not found")
	// ErrDeleted: the runtime session is tombstoned; it answers NOT_FOUND from now on.
	ErrDeleted = errors.New("runtime session deleted")
	// ErrConflict: CreateRuntimeSession with other metadata than the stored one.
	ErrConflict = errors.New("runtime session exists with other metadata")
)

// Violation is one bad field of a request, named by its path in the request
// (items[3].payload), the way BadRequest field violations name them.
type Violation struct {
	Field       string
	Description string
	Limit       bool // a size or count limit, not a malformed value
}

// InvalidError carries every violation found in a request; nothing of it was applied.
type InvalidError struct {
	Violations []Violation
}

func (e *InvalidError) Error() string {
	if len(e.Violations) == 0 {
		return "invalid request"
	}
	return fmt.Sprintf("invalid request: %s: %s (and %d more)", e.Violations[0].Field, e.Violations[0].Description, len(e.Violations)-1)
}

// HasLimit reports whether any violation is a size or count limit.
func (e *InvalidError) HasLimit() bool {
	for _, v := range e.Violations {
		if v.Limit {
			return true
		}
	}
	return false
}

// Invalid returns an *InvalidError for vs, or nil when vs is empty.
func Invalid(vs []Violation) error {
	if len(vs) == 0 {
		return nil
	}
	return &InvalidError{Violations: vs}
}

// ValidID reports whether s is 1..MaxIDLength characters of [a-zA-Z0-9_.:-]. Runtime session
// ids obey the same rule, which also keeps '{' and '}' out of Redis hash tags.
func ValidID(s string) bool {
	if len(s) == 0 || len(s) > MaxIDLength {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case c == '_', c == '.', c == ':', c == '-':
		default:
			return false
		}
	}
	return true
}

// ValidateRuntimeSessionID returns the violation of a bad runtime session id at field: the
// id rule of every API (pkg/ident), stricter than an item id's (no "..").
func ValidateRuntimeSessionID(field, id string) []Violation {
	return ValidateRef(field, id, ident.ID)
}

// ValidateRef returns the violation check reports for v at field (an ident rule).
func ValidateRef(field, v string, check func(string) string) []Violation {
	if d := check(v); d != "" {
		return []Violation{{Field: field, Description: d}}
	}
	return nil
}

// ValidateItem returns every violation of one item; prefix is its path, e.g. "items[3]".
func ValidateItem(prefix string, it Item) []Violation {
	return validateItem(func() string { return prefix }, it)
}

// validateItem builds the item's path only when it has a violation: most batches have
// none, and a formatted path per item was a measurable part of ingesting one.
func validateItem(prefix func() string, it Item) []Violation {
	var vs []Violation
	bad := func(field, desc string) { vs = append(vs, Violation{Field: prefix() + "." + field, Description: desc}) }
	if !ValidID(it.ID) {
		bad("item_id", "must be 1 to 128 characters of [a-zA-Z0-9_.:-]")
	}
	if !it.Type.Known() {
		bad("type", "must be a known item type")
	}
	if it.Version < 1 {
		bad("version", "must be at least 1")
	}
	if it.ParentID != "" && !ValidID(it.ParentID) {
		bad("parent_id", "must be empty or 1 to 128 characters of [a-zA-Z0-9_.:-]")
	}
	switch {
	case len(it.Payload) > MaxItemPayloadBytes:
		vs = append(vs, Violation{prefix() + ".payload", fmt.Sprintf("is %d bytes, more than the limit of %d", len(it.Payload), MaxItemPayloadBytes), true})
	case !validJSON(it.Payload):
		bad("payload", "must be valid JSON")
	}
	return vs
}

// ValidateBatch returns every violation of a batch: the batch limits first (field "items"),
// then each item's. A batch with any violation must not be stored at all.
func ValidateBatch(items []Item) []Violation {
	var vs []Violation
	if len(items) == 0 {
		vs = append(vs, Violation{Field: "items", Description: "must hold at least one item"})
	}
	if len(items) > MaxBatchItems {
		vs = append(vs, Violation{"items", fmt.Sprintf("holds %d items, more than the limit of %d", len(items), MaxBatchItems), true})
	}
	total := 0
	for _, it := range items {
		total += len(it.Payload)
	}
	if total > MaxBatchBytes {
		vs = append(vs, Violation{"items", fmt.Sprintf("payloads total %d bytes, more than the limit of %d", total, MaxBatchBytes), true})
	}
	for i, it := range items {
		vs = append(vs, validateItem(func() string { return "items[" + strconv.Itoa(i) + "]" }, it)...)
	}
	return vs
}

// RuntimeSession is a stored history's metadata.
type RuntimeSession struct {
	ID         string
	SessionID  string
	SandboxID  string
	Directory  string
	CreateTime time.Time
}

// BatchResult reports a stored batch.
type BatchResult struct {
	Applied int // items newer than the stored version
	Ignored int // items whose version was already stored or older
	Cursor  string
}
