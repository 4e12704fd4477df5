package server

import (
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

const warmSessions = 100

// BenchmarkWarmSendToAccepted measures SendMessage → accepted on warm
// routes across 100 sessions. A client sends to a ready session and waits on
// that session's WatchSession stream for the message's ACCEPTED event (the
// fake sandbox accepts delivery at once). Every 10th message of a session a
// turn outcome settles its accepted messages, as a runtime would, outside the
// measured span (counted per session: a global count settled only some
// sessions, and the others piled up hundreds of accepted messages that
// every transition then loads).
//
//   - latency: one message in flight at a time, round robin over the sessions;
//   - throughput: 100 clients at once, one per session (closed loop).
func BenchmarkWarmSendToAccepted(b *testing.B) {
	e := newEnv(b, func(c *Config) {
		c.LogLevel = slog.LevelWarn
		c.RedisURL += "?pool_size=256"
		// As deployed: the tests' 200 ms made every idle watcher poll (XREAD
		// plus a liveness read) 5 times a second, about once per message in
		// the latency run, where each session waits ~100 sends for its turn.
		c.WatchBlock = DefaultConfig().WatchBlock
	})
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
	// Messages per session since its last outcome; a session is used by one
	// goroutine at a time (round robin, or its own client).
	var sent [warmSessions]int
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
		if sent[i]++; sent[i] == 10 {
			sent[i] = 0
			out := &runtimev1.TurnOutcome{TurnId: "t" + mid, LastMessageId: mid, Result: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED}
			if _, err := e.notify.NotifyTurnOutcome(e.ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: e.route(sid, 1), Outcome: out}); err != nil {
				tb.Fatal(err)
			}
		}
		return d
	}
	b.Run("latency", func(b *testing.B) {
		lat := make([]time.Duration, 0, b.N)
		c0 := e.cpu()
		for i := range b.N {
			lat = append(lat, one(b, i%warmSessions))
		}
		report(b, lat, 0)
		e.cpu().reportSince(b, c0)
	})
	b.Run("throughput", func(b *testing.B) {
		var next atomic.Int64
		lat := make([][]time.Duration, warmSessions)
		var wg sync.WaitGroup
		c0 := e.cpu()
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
		e.cpu().reportSince(b, c0)
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

// cpuUse is CPU time spent so far by this test process (benchmark client,
// session service and fake peers) and by redis-server, and the number of
// commands Redis ran: divided by messages, it does not depend on how busy
// the shared machine is, unlike wall-clock throughput.
type cpuUse struct {
	proc, redis time.Duration
	cmds        int64
}

func (e *env) cpu() cpuUse {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		e.t.Fatal(err)
	}
	u := cpuUse{proc: time.Duration(ru.Utime.Nano() + ru.Stime.Nano())}
	info, err := e.rdb.Info(e.ctx, "cpu", "stats").Result()
	if err != nil {
		e.t.Fatal(err)
	}
	for line := range strings.Lines(info) {
		k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
		switch k {
		case "used_cpu_sys", "used_cpu_user":
			f, _ := strconv.ParseFloat(v, 64)
			u.redis += time.Duration(f * float64(time.Second))
		case "total_commands_processed":
			u.cmds, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	return u
}

func (u cpuUse) reportSince(b *testing.B, c0 cpuUse) {
	n := float64(b.N)
	b.ReportMetric(float64((u.proc-c0.proc).Microseconds())/n, "go-cpu-µs/msg")
	b.ReportMetric(float64((u.redis-c0.redis).Microseconds())/n, "redis-cpu-µs/msg")
	b.ReportMetric(float64(u.cmds-c0.cmds)/n, "redis-cmds/msg")
}
