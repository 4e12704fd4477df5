package session

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Bounds of a session's own suspend_after (CreateSession).
const (
	MinSuspendAfter = time.Second
	MaxSuspendAfter = 30 * 24 * time.Hour
)

// CheckSuspendAfter checks a CreateSession's suspend_after: zero (absent)
// takes the profile's default, anything else must be within the bounds.
func CheckSuspendAfter(field string, d time.Duration) []Violation {
	if d == 0 || (d >= MinSuspendAfter && d <= MaxSuspendAfter) {
		return nil
	}
	return []Violation{{Field: field, Description: "must be absent (the agent profile's default) or 1s to 720h"}}
}

// SuspendPolicy says how long a session's runtime stays up after its last
// turn ended (DESIGN.md 3.8): the session's own SuspendAfter, else its
// agent profile's, else Default. A zero Default or profile value means
// never.
type SuspendPolicy struct {
	Default  time.Duration
	Profiles map[string]time.Duration
}

// After is how long s's runtime may stay idle; ≤ 0: never suspended.
func (p SuspendPolicy) After(s *Session) time.Duration {
	if s.SuspendAfter > 0 {
		return s.SuspendAfter
	}
	profile := s.Agent.Profile
	if profile == "" {
		profile = s.Route.AgentProfile
	}
	if d, ok := p.Profiles[profile]; ok {
		return d
	}
	return p.Default
}

// Due is when a's runtime is to be suspended, zero when it is not to be:
// a live session whose route is ready and that has no queued or accepted
// message becomes due After(s) past its last change (UpdateTime: every
// outcome, message and route change moves it, so it is never before the
// last turn ended). A running turn, however silent, keeps it running.
func (p SuspendPolicy) Due(a *Aggregate) time.Time {
	s := &a.Session
	if a.Intent != nil || s.State == StateDeleting || s.Route.State != RouteReady ||
		slices.ContainsFunc(a.Active, isActive) {
		return time.Time{}
	}
	after := p.After(s)
	if after <= 0 {
		return time.Time{}
	}
	return s.UpdateTime.Add(after)
}

// ParseProfileDurations reads "profile=duration,..." (e.g.
// "opencode=5m,kilo=0"); empty is none.
func ParseProfileDurations(v string) (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	for part := range strings.SplitSeq(v, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, val, ok := strings.Cut(part, "=")
		name = strings.TrimSpace(name)
		if !ok || name == "" {
			return nil, fmt.Errorf("%q: want profile=duration", part)
		}
		d, err := time.ParseDuration(strings.TrimSpace(val))
		if err != nil {
			return nil, fmt.Errorf("%q: %w", part, err)
		}
		if d != 0 && d < MinSuspendAfter {
			return nil, fmt.Errorf("%q: 0 (never) or at least 1s", part)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("%q: profile named twice", name)
		}
		out[name] = d
	}
	return out, nil
}
