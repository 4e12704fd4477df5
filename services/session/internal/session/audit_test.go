package session

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestTurnAt(t *testing.T) {
	at := func(s int) time.Time { return time.Unix(int64(1000+s), 0) }
	queued := func(id string, seq uint64, created int) *Message {
		return &Message{ID: id, Seq: seq, State: MessageQueued, CreateTime: at(created)}
	}
	accepted := func(id string, seq uint64, created, acc int) *Message {
		m := queued(id, seq, created)
		m.State, m.AcceptTime = MessageAccepted, at(acc)
		return m
	}
	last := TurnSpan{MessageID: "m0", Queued: at(0), Start: at(2), End: at(10)}
	for _, c := range []struct {
		name   string
		active []*Message
		last   TurnSpan
		t      int
		want   string
	}{
		{"nothing", nil, TurnSpan{}, 5, ""},
		{"running", []*Message{accepted("m1", 1, 0, 2)}, TurnSpan{}, 5, "m1"},
		{"before the running turn was accepted: it was the next", []*Message{accepted("m1", 1, 0, 6)}, TurnSpan{}, 5, "m1"},
		{"waiting: the next", []*Message{queued("m1", 1, 0)}, TurnSpan{}, 5, "m1"},
		{"the oldest running one", []*Message{accepted("m1", 1, 0, 2), accepted("m2", 2, 1, 2)}, TurnSpan{}, 5, "m1"},
		{"ended, reported late", nil, last, 5, "m0"},
		{"ended, begun while queued (a clone)", nil, last, 1, "m0"},
		{"after the last turn: the next", []*Message{queued("m1", 1, 11)}, last, 12, "m1"},
		{"after the last turn, nothing next", nil, last, 12, ""},
		{"late for the last turn while another runs", []*Message{accepted("m1", 1, 11, 12)}, last, 5, "m0"},
	} {
		a := &Aggregate{Active: c.active}
		a.Session.LastTurn = c.last
		require.Equal(t, c.want, a.TurnAt(at(c.t)), c.name)
	}
}

func TestCountKey(t *testing.T) {
	r := AuditRecord{TurnID: "m1", Kind: AuditKindEgress, Egress: &AuditEgress{Host: "h", Port: 443, Decision: EgressDenied, Expected: true}}
	require.Equal(t, "m1|h:443", r.CountKey())
	r.Egress.Decision = "allowed"
	require.Empty(t, r.CountKey(), "an allowed connection is a record of its own")
	r = AuditRecord{Kind: AuditKindProxy, Proxy: &AuditProxy{}}
	require.Empty(t, r.CountKey())
}
