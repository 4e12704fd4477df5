package session

import (
	"fmt"
	"time"
)

// MaxFenceLead is how far past the service's clock a sandbox-owner fencing
// token may lie. Tokens are max(previous+1, Redis TIME in µs) (pkg/fence), so
// a real one is never ahead of the clock by more than clock skew; a token
// much further ahead could only be forged, and accepting it would make the
// session drop every notification of the real owner from then on.
const MaxFenceLead = 24 * time.Hour

// CheckFenceToken checks a notification's sandbox-owner fencing token: zero
// (no owner issues it) and tokens no owner could have issued yet are refused.
func CheckFenceToken(field string, token uint64, now time.Time) []Violation {
	if token == 0 {
		return []Violation{{field, "required: the fencing token of the sandbox owner"}}
	}
	limit := now.Add(MaxFenceLead).UnixMicro()
	if limit > 0 && token > uint64(limit) {
		return []Violation{{field, fmt.Sprintf("ahead of the clock by more than %s: no sandbox owner issued it", MaxFenceLead)}}
	}
	return nil
}
