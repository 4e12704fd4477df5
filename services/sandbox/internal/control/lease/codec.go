package lease

import (
	"encoding/json"
	"fmt"
	"time"
)

// Encode serializes a lease for Redis.
func Encode(l Lease) ([]byte, error) {
	if l.State == "" {
		l.State = None
	}
	return json.Marshal(l)
}

// Decode parses a stored lease. A lease that fails to parse (bad JSON,
// unknown state, inconsistent fields) is never read as none: it comes back
// quarantined as exhausted stop_needed targeting every wrapper of the key,
// with its generation floor raised to now in microseconds (above any
// counter a real lease reaches) so generations still never decrease. The
// error says why it was quarantined.
func Decode(data []byte, now time.Time) (Lease, error) {
	var l Lease
	err := json.Unmarshal(data, &l)
	if err == nil {
		err = validate(l)
	}
	if err != nil {
		return Quarantine(now), fmt.Errorf("lease: quarantined: %w", err)
	}
	return l, nil
}

// Quarantine is the lease that replaces one that cannot be read.
func Quarantine(now time.Time) Lease {
	return Lease{
		State:          StopNeeded,
		Exhausted:      true,
		StopReason:     ReasonQuarantine,
		NextGeneration: uint64(max(now.UnixMicro(), 1)),
		// Attempts are tracked by id; start far above any real id so a
		// stale result of a lost attempt can never match.
		LastAttempt:   uint64(max(now.UnixMicro(), 1)),
		ExhaustedAt:   now,
		NextAttemptAt: now,
	}
}

func validate(l Lease) error {
	switch l.State {
	case None, OwnsWrapper, StopNeeded, Stopping:
	default:
		return fmt.Errorf("unknown state %q", l.State)
	}
	if l.State == OwnsWrapper && (l.Instance == "" || l.Generation >= l.NextGeneration) {
		return fmt.Errorf("owns_wrapper without instance or with generation %d ≥ next %d", l.Generation, l.NextGeneration)
	}
	if l.State == Stopping && (l.WatchdogAt.IsZero() || l.LastAttempt == 0) {
		return fmt.Errorf("stopping without watchdog or attempt")
	}
	if l.Attempts < 0 {
		return fmt.Errorf("negative attempts")
	}
	return nil
}
