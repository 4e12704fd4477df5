package session

import (
	"strconv"
	"time"
)

// AuditKind says what an audit record describes.
type AuditKind string

const (
	// AuditKindProxy: a request the credential proxy forwarded.
	AuditKindProxy AuditKind = "proxy_request"
	// AuditKindEgress: a decision of the sandbox's egress proxy.
	AuditKindEgress AuditKind = "egress"
)

// AuditRecord is one audited action of a session's runtime (DESIGN.md 5
// "Usage and audit"), attributed to a turn by order: the turn running when
// it began, else the next one (never by a label the sandbox could forge).
type AuditRecord struct {
	// ID is the store's (the record's place in the session's audit log).
	ID               string       `json:"-"`
	TurnID           string       `json:"turn,omitempty"`
	RuntimeKey       string       `json:"runtime_key,omitempty"`
	RuntimeSessionID string       `json:"runtime_session,omitempty"`
	Kind             AuditKind    `json:"kind"`
	Time             time.Time    `json:"time"`
	Proxy            *AuditProxy  `json:"proxy,omitempty"`
	Egress           *AuditEgress `json:"egress,omitempty"`
}

// AuditProxy is a forwarded request: its route, method and path template
// (never the raw path or query), status, body bytes each way and duration.
type AuditProxy struct {
	Route        string        `json:"route"`
	Method       string        `json:"method"`
	PathTemplate string        `json:"path"`
	Status       int           `json:"status"`
	BytesIn      uint64        `json:"in,omitempty"`
	BytesOut     uint64        `json:"out,omitempty"`
	Duration     time.Duration `json:"dur,omitempty"`
}

// AuditEgress is an egress decision. Expected denials (a host the agent
// profile names) are counted on one record per turn, host and port: Count
// is how many it stands for (set when read).
type AuditEgress struct {
	Host       string `json:"host"`
	Port       int    `json:"port"`
	Decision   string `json:"decision"`
	Reason     string `json:"reason,omitempty"`
	Connection string `json:"conn,omitempty"`
	BytesUp    uint64 `json:"up,omitempty"`
	BytesDown  uint64 `json:"down,omitempty"`
	Expected   bool   `json:"expected,omitempty"`
	Count      uint64 `json:"-"`
}

// EgressDenied is the egress proxy's decision for a refused connection.
const EgressDenied = "denied"

// CountKey is the key an expected denial is counted under (its turn, host
// and port), or "" for a record that stands for itself.
func (r *AuditRecord) CountKey() string {
	if r.Kind != AuditKindEgress || r.Egress == nil || !r.Egress.Expected || r.Egress.Decision != EgressDenied {
		return ""
	}
	return r.TurnID + "|" + r.Egress.Host + ":" + strconv.Itoa(r.Egress.Port)
}

// TurnSpan is the most recent turn that ended with an outcome: its
// message, when that was queued and accepted, and when the outcome came.
// A report that reaches the service after its turn ended (the proxy
// reports in batches) is attributed to it by its start time: one that
// began while the message was queued (its route's clone) or while its
// turn ran.
type TurnSpan struct {
	MessageID string    `json:"message_id"`
	Queued    time.Time `json:"queued"`
	Start     time.Time `json:"start"`
	End       time.Time `json:"end"`
}

// TurnAt names the turn an action that began at t belongs to: the turn
// running then (the oldest accepted message accepted by t), else the last
// ended turn when t falls between its message's queueing and its outcome
// (a late report), else the next (the oldest queued or accepted message);
// "" when the session has none.
func (a *Aggregate) TurnAt(t time.Time) string {
	next := ""
	for _, m := range a.Active { // queue order
		if m.State == MessageAccepted && !m.AcceptTime.IsZero() && !m.AcceptTime.After(t) {
			return m.ID
		}
		if next == "" {
			next = m.ID
		}
	}
	if lt := a.Session.LastTurn; lt.MessageID != "" && !t.Before(lt.Queued) && !t.After(lt.End) {
		return lt.MessageID
	}
	return next
}

// endTurn records the turn an outcome ends: the oldest accepted message
// it settles (upTo: the newest settled message's queue position).
func (a *Aggregate) endTurn(upTo uint64, now time.Time) {
	for _, m := range a.Active {
		if m.State == MessageAccepted && m.Seq <= upTo {
			a.Session.LastTurn = TurnSpan{MessageID: m.ID, Queued: m.CreateTime, Start: m.AcceptTime, End: now}
			a.sessionChanged = true
			return
		}
	}
}
