package server

import (
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

const warmSessions = 100

// BenchmarkWarmSendToAccepted measures SendMessage → accepted on warm
// routes across 100 sessions. A client sends to a ready session and waits on
// that session's WatchSession stream for the message's ACCEPTED event (the
// fake sandbox accepts delivery at once). Every 10 messages a turn outcome
// settles them, as a runtime would, outside the measured span.
//
//   - latency: one message in flight at a time, round robin over the sessions;
//   - throughput: 100 clients at once, one per session (closed loop).
func BenchmarkWarmSendToAccepted(b *testing.B) {
	e := newEnv(b, func(c *Config) { c.LogLevel = slog.LevelWarn; c.RedisURL += "?pool_size=256" })
	e.sandbox.readyOnPrepare.Store(true)
	streams := make([]sessionv1.SessionService_WatchSessionClient, warmSessions)
	for i := range warmSessions {
		sid := fmt.Sprint("w", i)
		e.create(sid, fmt.Sprint("u", i), "/work/repo")
		e.ready(sid, "w1")
		// From the start of the log: "$" would race with the first send (the
		// server resolves it when the stream starts, after this call returns).
		s, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: sid})
		if err != nil {
			b.Fatal(err)
		}
		streams[i] = s
		// Warm up: one message end to end, which also proves the stream is live.
		warm := e.send(sid, "warm", "warm")
		waitAccepted(b, s, warm.GetMessageId())
	}
	var seq atomic.Int64
	one := func(tb testing.TB, i int) time.Duration {
		sid := fmt.Sprint("w", i)
		n := seq.Add(1)
		mid := fmt.Sprint("m", n)
		t0 := time.Now()
		if _, err := e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: sid, MessageId: mid, Content: "do it"}); err != nil {
			tb.Fatal(err)
		}
		waitAccepted(tb, streams[i], mid)
		d := time.Since(t0)
		if n%10 == 0 {
			out := &runtimev1.TurnOutcome{TurnId: "t" + mid, LastMessageId: mid, Result: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED}
			if _, err := e.notify.NotifyTurnOutcome(e.ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: e.route(sid, 1), Outcome: out}); err != nil {
				tb.Fatal(err)
			}
		}
		return d
	}
	b.Run("latency", func(b *testing.B) {
		lat := make([]time.Duration, 0, b.N)
		for i := range b.N {
			lat = append(lat, one(b, i%warmSessions))
		}
		report(b, lat, 0)
	})
	b.Run("throughput", func(b *testing.B) {
		var next atomic.Int64
		lat := make([][]time.Duration, warmSessions)
		var wg sync.WaitGroup
		start := time.Now()
		for i := range warmSessions {
			wg.Go(func() {
				for n := next.Add(1); n <= int64(b.N); n = next.Add(1) {
					lat[i] = append(lat[i], one(b, i))
				}
			})
		}
		wg.Wait()
		report(b, slices.Concat(lat...), time.Since(start))
	})
}

func report(b *testing.B, lat []time.Duration, elapsed time.Duration) {
	slices.Sort(lat)
	if len(lat) == 0 {
		return
	}
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
	if elapsed > 0 {
		b.ReportMetric(float64(len(lat))/elapsed.Seconds(), "msgs/s")
	}
}

func waitAccepted(tb testing.TB, s sessionv1.SessionService_WatchSessionClient, mid string) {
	for {
		resp, err := s.Recv()
		if err != nil {
			tb.Fatal(err)
		}
		if m := resp.GetEvent().GetMessage(); m != nil && m.GetMessageId() == mid &&
			m.GetState() == sessionv1.MessageState_MESSAGE_STATE_ACCEPTED {
			return
		}
	}
}
