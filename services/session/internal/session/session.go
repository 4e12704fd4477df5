// Package session is the session service's domain: sessions, their message
// queue and message states, the route view, events and the deletion intent
// (DESIGN.md 2, 3.1 and 3.5). It is pure: no I/O, no gRPC, no generated code.
// The store loads an Aggregate, a transition mutates it and records what
// changed, and the store writes exactly those changes.
package session

import (
	"agentplane.dev/pkg/egresspolicy"
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"strings"
	"time"
)

// State is the lifecycle of a session.
type State string

const (
	StateActive   State = "active"
	StateStopped  State = "stopped"
	StateDeleting State = "deleting"
)

// MessageState is the lifecycle of a message: queued → accepted →
// completed | failed | cancelled. Terminal states are final.
type MessageState string

const (
	MessageQueued    MessageState = "queued"
	MessageAccepted  MessageState = "accepted"
	MessageCompleted MessageState = "completed"
	MessageFailed    MessageState = "failed"
	MessageCancelled MessageState = "cancelled"
)

// Terminal reports whether no transition leaves s.
func (s MessageState) Terminal() bool {
	return s == MessageCompleted || s == MessageFailed || s == MessageCancelled
}

// RouteState is the session's view of its route.
type RouteState string

const (
	RouteUnknown      RouteState = "unknown"
	RoutePreparing    RouteState = "preparing"
	RouteReady        RouteState = "ready"
	RouteReconnecting RouteState = "reconnecting"
	RouteFailed       RouteState = "failed"
	// RouteSuspended: SuspendSession stopped the runtime (verified absent);
	// workspace, the agent's home and history stay. The next message or
	// ResumeSession prepares the route again.
	RouteSuspended RouteState = "suspended"
)

// ReasonSuspend is the sandbox service's stop reason of a suspended
// runtime key: a route lost or failed for it is suspended, not lost.
const ReasonSuspend = "suspend"

// ReasonResumeStateLost is the sandbox's route failure for a resume whose
// workspace or agent home is gone; ResumeSession with restart continues
// with a new conversation.
const ReasonResumeStateLost = "resume_state_lost"

// CredentialClass is the kind of backing credential.
type CredentialClass string

const (
	CredentialDelegated CredentialClass = "delegated"
	CredentialStatic    CredentialClass = "static"
)

// Failure reasons of messages (lower snake, as the API documents them).
const (
	ReasonPreparationTimeout = "preparation_timeout"
	ReasonNoOutcome          = "no_outcome"
	ReasonAgentRestarted     = "agent_restarted"
	ReasonRouteFailed        = "route_failed"
	ReasonRouteLost          = "route_lost"
	ReasonTurnFailed         = "turn_failed"
	// A sandbox's limit stopped its runtime in the turn (DESIGN.md 3.3
	// "Limits per sandbox"): as the sandbox service names it.
	ReasonMemoryLimit = "memory_limit"
	ReasonDiskQuota   = "disk_quota"
)

// RouteView is what the session knows of its route.
type RouteView struct {
	State            RouteState `json:"state"`
	Step             string     `json:"step,omitempty"`
	FailureReason    string     `json:"failure_reason,omitempty"`
	RuntimeSessionID string     `json:"runtime_session_id,omitempty"`
	SandboxID        string     `json:"sandbox_id,omitempty"`
	WrapperInstance  string     `json:"wrapper_instance,omitempty"`
	// AgentProfile and AgentModel name the agent the runtime runs, while
	// ready (the session's: the wrapper refuses a route for another).
	AgentProfile string    `json:"agent_profile,omitempty"`
	AgentModel   string    `json:"agent_model,omitempty"`
	UpdateTime   time.Time `json:"update_time"`
	// FenceToken is the newest sandbox-owner fencing token seen in a
	// notification; notifications with an older token come from a deposed
	// sandbox replica and are dropped.
	FenceToken uint64 `json:"fence_token,omitempty"`
}

// Session is one agent conversation of a user on a worktree.
type Session struct {
	ID        string `json:"id"`
	UserID    string `json:"user_id"`
	OrgID     string `json:"org_id"`
	RepoURL   string `json:"repo_url,omitempty"`
	RepoRef   string `json:"repo_ref,omitempty"`
	RepoDepth uint32 `json:"repo_depth,omitempty"`
	// GitCredentialRef names the git token in the credential service;
	// GitSecretDigest is its SHA-256 (for idempotent create only).
	GitCredentialRef string `json:"git_credential_ref,omitempty"`
	GitSecretDigest  string `json:"git_secret_digest,omitempty"`
	// PushPrefix is git_credential.push_branch_prefix as asked ("": the
	// default); PushBranchPrefix is the one in force.
	PushPrefix      string          `json:"push_prefix,omitempty"`
	Directory       string          `json:"directory"`
	CredentialClass CredentialClass `json:"credential_class"`
	CredentialRef   string          `json:"credential_ref,omitempty"`
	SecretDigest    string          `json:"secret_digest"` // SHA-256 hex; for idempotent create only
	SandboxID       string          `json:"sandbox_id"`
	State           State           `json:"state"`
	Route           RouteView       `json:"route"`
	// RuntimeSessionIDs is every runtime session id the route ever had
	// (each re-preparation after a lost, failed or released route gets a
	// new one, each with its own ingest history); deletion tombstones all.
	RuntimeSessionIDs []string          `json:"runtime_session_ids,omitempty"`
	Labels            map[string]string `json:"labels,omitempty"`
	Agent             Agent             `json:"agent,omitzero"`
	// Egress is the session's egress policy; EgressVersion counts its
	// changes (1 at creation).
	Egress        egresspolicy.Policy `json:"egress,omitzero"`
	EgressVersion uint64              `json:"egress_version,omitempty"`
	// SuspendAfter is the session's own suspend_after (zero: its agent
	// profile's default; SuspendPolicy).
	SuspendAfter time.Duration `json:"suspend_after,omitempty"`
	// ResumeSince is when the resume of a suspended route began (a message
	// sent to it, ResumeSession, or the route leaving suspended), until the
	// route is ready or fails: the resume latency metric reads it. Zero: no
	// resume under way.
	ResumeSince time.Time `json:"resume_since,omitzero"`
	// Usage is the session's provider tokens so far; TurnUsage those
	// counted since its previous turn outcome (the next outcome's).
	Usage     Usage `json:"usage,omitzero"`
	TurnUsage Usage `json:"turn_usage,omitzero"`
	// LastTurn is the most recent turn an outcome ended (audit records
	// reported after their turn ended are attributed by it: TurnAt).
	LastTurn   TurnSpan  `json:"last_turn,omitzero"`
	LastSeq    uint64    `json:"last_seq"`
	CreateTime time.Time `json:"create_time"`
	UpdateTime time.Time `json:"update_time"`
}

// recordRuntimeSession remembers a runtime session id of the route; it
// reports whether the id was new.
func (s *Session) recordRuntimeSession(id string) bool {
	if id == "" || slices.Contains(s.RuntimeSessionIDs, id) {
		return false
	}
	s.RuntimeSessionIDs = append(s.RuntimeSessionIDs, id)
	return true
}

// Agent is the coding agent a session runs: a sandbox-service profile, a
// model and the tool kinds whose permission requests are rejected.
type Agent struct {
	Profile         string   `json:"profile,omitempty"`
	Model           string   `json:"model,omitempty"`
	RejectToolKinds []string `json:"reject_tool_kinds,omitempty"`
}

// Message is one user message. Content is stored apart from the state so
// that transitions never load message text.
type Message struct {
	SessionID     string       `json:"session_id"`
	ID            string       `json:"id"`
	Content       string       `json:"-"`
	ContentDigest string       `json:"content_digest"`
	State         MessageState `json:"state"`
	FailureReason string       `json:"failure_reason,omitempty"`
	Seq           uint64       `json:"seq"`
	CreateTime    time.Time    `json:"create_time"`
	UpdateTime    time.Time    `json:"update_time"`
	AcceptTime    time.Time    `json:"accept_time,omitzero"`
}

// Digest is the hex SHA-256 of s (message content, backing secret): enough
// to compare a retry with the original without keeping the value.
func Digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// SandboxFor derives the default sandbox of a user: one per (org, user), so
// every session of the user's worktree directories shares a sandbox and the
// sessions of one directory share its runtime.
func SandboxFor(orgID, userID string) string {
	sum := sha256.Sum256([]byte(orgID + "\x00" + userID))
	return "sbx-" + hex.EncodeToString(sum[:8])
}

// Tenant is who a session, and the sandbox it runs in, belongs to.
type Tenant struct {
	Org, User string
}

// OthersDefaultSandbox reports whether sandboxID has the shape of a default
// sandbox ("sbx-" and 16 lower-case hex digits) but is not the tenant's own:
// anyone can compute another tenant's default id, so naming one first must
// not take it from its tenant.
func OthersDefaultSandbox(sandboxID string, t Tenant) bool {
	rest, ok := strings.CutPrefix(sandboxID, "sbx-")
	if !ok || len(rest) != 16 || strings.ToLower(rest) != rest {
		return false
	}
	if _, err := hex.DecodeString(rest); err != nil {
		return false
	}
	return sandboxID != SandboxFor(t.Org, t.User)
}
