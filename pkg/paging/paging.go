// Package paging holds the one page-size rule of every list call
// (ListSessions, ListMessages, Export): page_size 0 means the call's
// documented default, 1 to MaxPageSize that many, anything else is
// INVALID_ARGUMENT with a field violation on page_size. Never clamped: a
// caller asking for more than the cap learns it at once instead of
// reading short pages it did not expect.
package paging

import "fmt"

// MaxPageSize is the largest page_size any list call accepts.
const MaxPageSize = 500

// Check returns the field violation description for page size n, or ""
// when n is admitted.
func Check(n int32) string {
	if n < 0 || n > MaxPageSize {
		return fmt.Sprintf("must be 0 (the default) to %d", MaxPageSize)
	}
	return ""
}
