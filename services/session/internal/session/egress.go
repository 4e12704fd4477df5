package session

import (
	"errors"
	"time"

	"agentplane.dev/pkg/egresspolicy"
)

// ErrEgressVersionConflict: UpdateEgressPolicy named a version that is not
// the current one (another update came first).
var ErrEgressVersionConflict = errors.New("egress policy version conflict")

// CheckEgress checks a policy of at most maxRules rules; violations name
// fields under field ("egress.allow[0].host").
func CheckEgress(field string, p egresspolicy.Policy, maxRules int) []Violation {
	var vs []Violation
	for _, pr := range p.Validate(maxRules) {
		vs = append(vs, Violation{Field: field + "." + pr.Field, Description: pr.Description})
	}
	return vs
}

// SetEgress replaces the session's egress policy when expected is 0 or the
// current version, and returns the new version.
func (a *Aggregate) SetEgress(p egresspolicy.Policy, expected uint64, now time.Time) (uint64, error) {
	if a.Intent != nil {
		return 0, ErrSessionNotFound
	}
	if expected != 0 && expected != a.Session.EgressVersion {
		return 0, ErrEgressVersionConflict
	}
	a.Session.Egress = p
	a.Session.EgressVersion++
	a.touch(now)
	a.emitSession(now)
	return a.Session.EgressVersion, nil
}
