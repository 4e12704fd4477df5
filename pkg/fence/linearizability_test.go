package fence_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

// The sequential model of one resource's lease, its fencing token and one
// guarded value.
//
// How a restart without persistence fits: it is an operation of its own
// (from kill to ready) whose step empties the lease, the token key and the
// value, but keeps `last`, the newest token granted: tokens must keep
// increasing across it (the TIME floor). After a restart the token key is
// unknown to Redis, so every guarded write fails closed until the next
// acquire.
//
// Operations that fail with a connection error have an unknown outcome: they
// may or may not have taken effect before the server died. The model then
// allows both. An acquire whose token the client never learned leaves a
// "ghost" holder (token unknown, so no known token can write) that only the
// restart clears — it ran just before the kill, so the restart wiped it.
// The lease TTL is far longer than the run, so expiry is not modelled.
type lstate struct {
	holder      int    // client holding the lease, -1 none
	token       uint64 // its token (0 for a ghost)
	last        uint64 // newest token granted by anyone
	lastUnknown bool   // a ghost got a token newer than last
	tokenKey    bool   // Redis still knows the newest token
	value       string // the guarded value
}

type opKind int

const (
	opAcquire opKind = iota
	opRenew
	opRelease
	opWrite
	opRead
	opRestart
)

type lin struct {
	kind   opKind
	client int
	token  uint64
	value  string
}

type lout struct {
	unknown bool   // connection error: outcome unknown
	ok      bool   // granted / renewed / released / written
	token   uint64 // acquire
	value   string // read
}

func (s lstate) valid(client int, tok uint64) bool {
	return s.holder == client && s.token == tok && tok != 0
}
func (s lstate) writable(tok uint64) bool { return s.tokenKey && !s.lastUnknown && tok == s.last }

func stepLease(st, in, out any) []any {
	s, i, o := st.(lstate), in.(lin), out.(lout)
	switch i.kind {
	case opRestart:
		return []any{lstate{holder: -1, last: s.last, lastUnknown: s.lastUnknown}}
	case opAcquire:
		if o.unknown {
			res := []any{s}
			if s.holder == -1 {
				res = append(res, lstate{holder: i.client, last: s.last, lastUnknown: true, tokenKey: true, value: s.value})
			}
			return res
		}
		if !o.ok {
			if s.holder != -1 {
				return []any{s}
			}
			return nil
		}
		if s.holder != -1 || o.token <= s.last {
			return nil
		}
		return []any{lstate{holder: i.client, token: o.token, last: o.token, tokenKey: true, value: s.value}}
	case opRenew:
		if o.unknown || o.ok == s.valid(i.client, i.token) {
			return []any{s}
		}
		return nil
	case opRelease:
		released := s
		released.holder, released.token = -1, 0
		switch {
		case o.unknown && s.valid(i.client, i.token):
			return []any{s, released}
		case o.unknown || (!o.ok && !s.valid(i.client, i.token)):
			return []any{s}
		case o.ok && s.valid(i.client, i.token):
			return []any{released}
		}
		return nil
	case opWrite:
		written := s
		written.value = i.value
		switch {
		case o.unknown && s.writable(i.token):
			return []any{s, written}
		case o.unknown || (!o.ok && !s.writable(i.token)):
			return []any{s}
		case o.ok && s.writable(i.token):
			return []any{written}
		}
		return nil
	case opRead:
		if o.unknown || o.value == s.value {
			return []any{s}
		}
		return nil
	}
	return nil
}

var leaseModel = porcupine.NondeterministicModel{
	Init: func() []any { return []any{lstate{holder: -1}} },
	Step: stepLease,
	DescribeOperation: func(in, out any) string {
		return fmt.Sprintf("%+v -> %+v", in, out)
	},
	DescribeState: func(st any) string { return fmt.Sprintf("%+v", st) },
}

// The model itself must reject bad histories, or the check proves nothing.
func TestLeaseModelRejectsViolations(t *testing.T) {
	m := leaseModel.ToModel()
	op := func(c int, call, ret int64, in lin, out lout) porcupine.Operation {
		return porcupine.Operation{ClientId: c, Input: in, Call: call, Output: out, Return: ret}
	}
	bad := map[string][]porcupine.Operation{
		"two holders": {
			op(0, 0, 1, lin{kind: opAcquire, client: 0}, lout{ok: true, token: 5}),
			op(1, 2, 3, lin{kind: opAcquire, client: 1}, lout{ok: true, token: 6}),
		},
		"token goes back after restart": {
			op(0, 0, 1, lin{kind: opAcquire, client: 0}, lout{ok: true, token: 5}),
			op(2, 2, 3, lin{kind: opRestart}, lout{ok: true}),
			op(1, 4, 5, lin{kind: opAcquire, client: 1}, lout{ok: true, token: 4}),
		},
		"stale write accepted": {
			op(0, 0, 1, lin{kind: opAcquire, client: 0}, lout{ok: true, token: 5}),
			op(0, 2, 3, lin{kind: opRelease, client: 0, token: 5}, lout{ok: true}),
			op(1, 4, 5, lin{kind: opAcquire, client: 1}, lout{ok: true, token: 6}),
			op(0, 6, 7, lin{kind: opWrite, client: 0, token: 5, value: "x"}, lout{ok: true}),
		},
		"write after restart accepted": {
			op(0, 0, 1, lin{kind: opAcquire, client: 0}, lout{ok: true, token: 5}),
			op(2, 2, 3, lin{kind: opRestart}, lout{ok: true}),
			op(0, 4, 5, lin{kind: opWrite, client: 0, token: 5, value: "x"}, lout{ok: true}),
		},
		"renew of lost lease": {
			op(0, 0, 1, lin{kind: opAcquire, client: 0}, lout{ok: true, token: 5}),
			op(2, 2, 3, lin{kind: opRestart}, lout{ok: true}),
			op(0, 4, 5, lin{kind: opRenew, client: 0, token: 5}, lout{ok: true}),
		},
	}
	for name, h := range bad {
		require.False(t, porcupine.CheckOperations(m, h), name)
	}
	good := []porcupine.Operation{
		op(0, 0, 1, lin{kind: opAcquire, client: 0}, lout{ok: true, token: 5}),
		op(0, 2, 3, lin{kind: opWrite, client: 0, token: 5, value: "x"}, lout{ok: true}),
		op(1, 2, 9, lin{kind: opAcquire, client: 1}, lout{unknown: true}),
		op(2, 4, 8, lin{kind: opRestart}, lout{ok: true}),
		op(0, 10, 11, lin{kind: opRead, client: 0}, lout{value: ""}),
		op(1, 12, 13, lin{kind: opAcquire, client: 1}, lout{ok: true, token: 9}),
	}
	require.True(t, porcupine.CheckOperations(m, good))
}

func TestLinearizableWithRestart(t *testing.T) {
	srv := redistest.Start(t)
	const workers, restarts = 4, 2
	const res = "lin"
	key := fence.Key(res, "v")
	begin := time.Now()
	now := func() int64 { return int64(time.Since(begin)) }

	var (
		mu      sync.Mutex
		history []porcupine.Operation
		stop    atomic.Bool
		wg      sync.WaitGroup
	)
	record := func(c int, call int64, in lin, out lout) {
		ret := now()
		mu.Lock()
		history = append(history, porcupine.Operation{ClientId: c, Input: in, Call: call, Output: out, Return: ret})
		mu.Unlock()
	}
	// classify maps an error to (ok, unknown); errs are the "clean no".
	classify := func(err error, no error) (bool, bool) {
		switch {
		case err == nil:
			return true, false
		case errors.Is(err, no):
			return false, false
		default:
			return false, true // connection error around a restart
		}
	}

	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opt := srv.Options()
			opt.MaxRetries = -1 // a retried command could run twice; keep outcomes simple
			rdb := redis.NewClient(opt)
			defer rdb.Close()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			var lastTok uint64 // kept after release to try stale writes
			seq := 0
			for !stop.Load() {
				call := now()
				l, err := fence.Acquire(ctx, rdb, res, "w"+strconv.Itoa(w), 30*time.Second)
				out := lout{}
				out.ok, out.unknown = classify(err, fence.ErrLeaseHeld)
				if out.ok {
					out.token = l.Token
					lastTok = l.Token
				}
				record(w, call, lin{kind: opAcquire, client: w}, out)
				for range rng.IntN(4) {
					call := now()
					in := lin{client: w, token: lastTok}
					var err error
					var o lout
					switch rng.IntN(4) {
					case 0:
						if l == nil {
							continue
						}
						in.kind, in.token = opRenew, l.Token
						err = l.Renew(ctx)
						o.ok, o.unknown = classify(err, fence.ErrLeaseLost)
					case 1, 2:
						in.kind = opWrite
						seq++
						in.value = fmt.Sprintf("%d-%d", w, seq)
						if lastTok == 0 {
							continue
						}
						err = fence.Guard(ctx, rdb, res, lastTok, fence.Set(key, in.value, 0))
						o.ok, o.unknown = classify(err, fence.ErrStaleToken)
					case 3:
						in.kind = opRead
						v, err := rdb.Get(ctx, key).Result()
						if errors.Is(err, redis.Nil) {
							err = nil
						}
						o.value, o.unknown = v, err != nil
					}
					record(w, call, in, o)
				}
				if l != nil {
					call := now()
					err := l.Release(ctx)
					o := lout{}
					o.ok, o.unknown = classify(err, fence.ErrLeaseLost)
					record(w, call, lin{kind: opRelease, client: w, token: l.Token}, o)
				}
				time.Sleep(time.Duration(rng.IntN(500)) * time.Microsecond)
			}
		}()
	}

	for range restarts {
		time.Sleep(300 * time.Millisecond)
		call := now()
		srv.Restart(t, redistest.DropData)
		record(workers, call, lin{kind: opRestart}, lout{ok: true})
	}
	time.Sleep(300 * time.Millisecond)
	stop.Store(true)
	wg.Wait()

	counts := map[opKind]int{}
	acquired, unknown := 0, 0
	for _, op := range history {
		if op.Output.(lout).unknown {
			unknown++
		}
		counts[op.Input.(lin).kind]++
		if o := op.Output.(lout); op.Input.(lin).kind == opAcquire && o.ok {
			acquired++
		}
	}
	t.Logf("history: %d ops (%v), %d grants, %d unknown outcomes", len(history), counts, acquired, unknown)
	require.Positive(t, acquired)
	require.Positive(t, counts[opWrite])

	result, info := porcupine.CheckOperationsVerbose(leaseModel.ToModel(), history, 30*time.Second)
	if result != porcupine.Ok {
		path := t.TempDir() + "/lin.html"
		_ = porcupine.VisualizePath(leaseModel.ToModel(), info, path)
		t.Fatalf("history is %s (visualization: %s)", result, path)
	}
}
