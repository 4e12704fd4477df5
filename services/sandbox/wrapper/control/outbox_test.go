package control

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/logging/logtest"
)

// Issue 33 item 11: past 10,000 queued frames the wrapper dropped every new
// frame silently, a turn's outcome included. Now a drop is counted and
// logged, and an outcome takes the place of the oldest events frame.
func TestAFullOutboxDropsEventsNotOutcomes(t *testing.T) {
	var logs logtest.Buffer
	s := New(Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, nil)
	events := func() *sandboxv1.ConnectRequest {
		return &sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_RuntimeEvents{RuntimeEvents: &sandboxv1.RuntimeEvents{}}}
	}
	for range maxOutbox + 1 {
		s.Emit(events())
	}
	require.Equal(t, uint64(1), s.Dropped(), "the events frame past the bound")
	require.Contains(t, logs.String(), "control frames dropped: the outbox is full")

	outcome := &sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Outcome{Outcome: &sandboxv1.TurnOutcome{}}}
	s.Emit(outcome)
	require.Equal(t, uint64(2), s.Dropped())
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Len(t, s.outbox, maxOutbox)
	require.Same(t, outcome, s.outbox[len(s.outbox)-1], "the outcome is queued, an events frame went instead")
}
