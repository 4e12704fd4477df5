package fence

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Every script of the package goes through run. Calls made at the same time
// on one client are sent together: while lanes batches are on the wire,
// later calls queue, and when a batch returns one of the queued callers
// sends the whole queue as one pipeline (one write, one read on one
// connection for all of them) and hands on to the next. Under load this
// divides the socket syscalls and wake-ups, which are most of the cost of a
// Redis call on both sides, by the batch size. A caller that finds a lane
// free sends its script itself, directly, so one goroutine sees no hand-off
// and no change.
//
// Each script stays atomic and runs between its caller's call and return,
// so batching changes no outcome; it only shares round trips.

// lanes is how many batches may be on the wire at once per client. With a
// single lane the client and Redis take turns: Redis runs a whole batch of
// scripts while the client waits, then the client wakes the batch's callers
// while Redis idles. Several lanes let the two overlap, and below lanes
// callers nobody waits for a hand-off: a queued caller costs a goroutine
// wake-up, which a batch of two barely pays for. Measured side by side at 8
// and 64 goroutines on 2 cores (docs/benchmarks.md): 6 lanes beat 4 and 8
// at 8 goroutines (the fenced cycle ahead of the lock libraries by the
// median) and still batch well at 64.
const lanes = 6

// batchers holds one batcher per client, and on a Redis Cluster client one
// per hash slot (issue 33 item 14): a batch, and a lane, then only ever
// waits for one node, so the calls of a master that died (hanging until the
// client's timeouts, retried until a replica is promoted) never hold the
// lanes that calls to healthy slots need. Clients live as long as the
// process and a cluster has 16384 slots, so the map stays bounded.
var batchers sync.Map // batcherKey -> *batcher

type batcherKey struct {
	rdb  redis.Scripter
	slot int // -1 for a single-node client
}

// pipeliner is what batching needs from a client; *redis.Client and
// *redis.ClusterClient have it (the cluster client splits a pipeline by
// node). Other Scripters run every script directly.
type pipeliner interface {
	redis.Scripter
	Pipeline() redis.Pipeliner
}

// run runs script with EVALSHA (EVAL when Redis lost its script cache).
func run(ctx context.Context, rdb redis.Scripter, script *luaScript, keys []string, args ...any) *redis.Cmd {
	var p pipeliner
	key := batcherKey{rdb: rdb, slot: -1}
	switch c := rdb.(type) {
	case *redis.Client:
		p = c
	case *redis.ClusterClient:
		p = c
		if len(keys) > 0 {
			key.slot = Slot(keys[0]) // every key of a script shares its hash tag
		}
	default:
		return runScript(ctx, rdb, script, keys, args)
	}
	b, ok := batchers.Load(key)
	if !ok {
		b, _ = batchers.LoadOrStore(key, &batcher{rdb: p})
	}
	return b.(*batcher).run(ctx, script, keys, args)
}

type batcher struct {
	rdb   pipeliner
	mu    sync.Mutex
	busy  int     // batches on the wire (or being sent), at most lanes
	queue []*call // calls waiting for the next batch
}

// call is one queued script. Its caller waits on wake: it is woken either
// with its result (cmd set) or to send the batch it heads.
type call struct {
	ctx    context.Context
	script *luaScript
	keys   []string
	args   []any
	cmd    *redis.Cmd
	batch  []*call // set when this caller must send batch
	wake   chan struct{}
}

func (b *batcher) run(ctx context.Context, script *luaScript, keys []string, args []any) *redis.Cmd {
	b.mu.Lock()
	if b.busy < lanes {
		b.busy++
		b.mu.Unlock()
		cmd := runScript(ctx, b.rdb, script, keys, args)
		b.handOn()
		return cmd
	}
	c := &call{ctx: ctx, script: script, keys: keys, args: args, wake: make(chan struct{}, 1)}
	b.queue = append(b.queue, c)
	b.mu.Unlock()
	// No select on ctx: a queued caller may be the one that must send the
	// batch, and its batch goes out as soon as any batch on the wire
	// returns; the client's read and write timeouts bound both.
	<-c.wake
	if c.batch != nil {
		b.send(c.batch)
	}
	return c.cmd
}

// handOn makes the first queued caller send everything queued on the lane
// that just came free, or frees the lane.
func (b *batcher) handOn() {
	b.mu.Lock()
	q := b.queue
	b.queue = nil
	if len(q) == 0 {
		b.busy--
		b.mu.Unlock()
		return
	}
	b.mu.Unlock()
	q[0].batch = q
	q[0].wake <- struct{}{}
}

// send runs the batch as one pipeline, hands the lane on, and then wakes
// every caller in the batch but the first (the sender itself). Handing on
// first puts the next batch on the wire before the woken callers compete
// for the CPU (at 8 goroutines on 2 cores the lease cycle gained about 4%).
// It uses the sender's context values without its cancellation: the other
// callers did not cancel.
func (b *batcher) send(q []*call) {
	ctx := context.WithoutCancel(q[0].ctx)
	if len(q) == 1 {
		q[0].cmd = runScript(ctx, b.rdb, q[0].script, q[0].keys, q[0].args)
		b.handOn()
		return
	}
	pipe := b.rdb.Pipeline()
	for _, c := range q {
		if c.script.once {
			c.cmd = c.script.queueOnce(ctx, pipe, c.keys, c.args) // the pipeline is then never resent
		} else {
			c.cmd = c.script.EvalSha(ctx, pipe, c.keys, c.args...)
		}
	}
	_, _ = pipe.Exec(ctx) // errors are in each call's cmd
	for _, c := range q {
		if isNoScript(c.cmd.Err()) {
			c.cmd = runScript(ctx, b.rdb, c.script, c.keys, c.args)
		}
	}
	b.handOn()
	for _, c := range q[1:] {
		c.wake <- struct{}{}
	}
}

// Slot is the Redis Cluster hash slot of key: CRC16-CCITT (XMODEM) of its
// hash tag, modulo 16384.
func Slot(key string) int {
	var crc uint16
	for _, c := range []byte(HashTag(key)) {
		crc ^= uint16(c) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc % 16384)
}
