package session

import (
	"slices"
	"time"
)

// DeletionIntent is persisted before any cleanup step and carries
// everything the cleanup needs, so the reconciler can finish a deletion even
// when the session record is gone (it never reads absence from missing data).
type DeletionIntent struct {
	SessionID        string    `json:"session_id"`
	OrgID            string    `json:"org_id"`
	UserID           string    `json:"user_id"`
	SessionCreate    time.Time `json:"session_create_time"`
	SandboxID        string    `json:"sandbox_id"`
	Directory        string    `json:"directory"`
	CredentialRef    string    `json:"credential_ref,omitempty"`
	GitCredentialRef string    `json:"git_credential_ref,omitempty"`
	RuntimeSessionID string    `json:"runtime_session_id,omitempty"` // the latest (intents written before runtime_session_ids)
	// RuntimeSessionIDs is every runtime session id the session ever had.
	RuntimeSessionIDs []string  `json:"runtime_session_ids,omitempty"`
	Reason            string    `json:"reason"` // client, retention
	CreateTime        time.Time `json:"create_time"`

	RouteReleased      bool `json:"route_released,omitempty"`
	CredentialReleased bool `json:"credential_released,omitempty"`
	HistoryDeleted     bool `json:"history_deleted,omitempty"`

	Attempts    int       `json:"attempts"`
	NextAttempt time.Time `json:"next_attempt"`
	Pending     string    `json:"pending,omitempty"` // step that is not done yet
}

// NewDeletionIntent captures what cleaning up s needs.
func NewDeletionIntent(s *Session, reason string, now time.Time) DeletionIntent {
	return DeletionIntent{
		SessionID: s.ID, OrgID: s.OrgID, UserID: s.UserID, SessionCreate: s.CreateTime, SandboxID: s.SandboxID, Directory: s.Directory,
		CredentialRef: s.CredentialRef, GitCredentialRef: s.GitCredentialRef, RuntimeSessionID: s.Route.RuntimeSessionID,
		RuntimeSessionIDs: slices.Clone(s.RuntimeSessionIDs),
		Reason:            reason, CreateTime: now, NextAttempt: now,
	}
}

// HistoryIDs is every runtime session whose history the deletion removes.
func (d *DeletionIntent) HistoryIDs() []string {
	ids := slices.Clone(d.RuntimeSessionIDs)
	if d.RuntimeSessionID != "" && !slices.Contains(ids, d.RuntimeSessionID) {
		ids = append(ids, d.RuntimeSessionID)
	}
	return ids
}

// Backoff is the persisted retry schedule of deletion attempts.
type Backoff struct {
	Base, Max time.Duration
}

// Delay is the wait after the given number of failed attempts (1, 2, ...):
// Base doubling up to Max, and never shorter than what the peer asked for.
func (b Backoff) Delay(attempts int, peerAsked time.Duration) time.Duration {
	d := b.Base
	for i := 1; i < attempts && d < b.Max; i++ {
		d *= 2
	}
	d = min(d, b.Max)
	return max(d, peerAsked)
}

// Postpone records a failed attempt and schedules the next one.
func (d *DeletionIntent) Postpone(b Backoff, step string, peerAsked time.Duration, now time.Time) time.Duration {
	d.Attempts++
	d.Pending = step
	delay := b.Delay(d.Attempts, peerAsked)
	d.NextAttempt = now.Add(delay)
	return delay
}
