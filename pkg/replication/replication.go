// Package replication makes a Redis client confirm each write on replicas
// before the write counts as done, so that a planned failover (the promoted
// replica has everything the master acknowledged) loses nothing a service
// acknowledged to its caller.
//
// Require installs a hook on the client: after a command or a pipeline that
// wrote succeeds, it writes a marker on the written key's own master and
// WAITs there for the configured number of replicas. Redis replicates one
// ordered stream per master, so a replica that acknowledged the marker has
// every write that master completed before it, whatever connection made
// them; the WAIT therefore need not share the write's connection (which
// go-redis' pool cannot promise), and a retried write that finds its first
// attempt already applied (an idempotent no-op) is confirmed too. A write
// that cannot be confirmed keeps its effect on the master but fails with
// storeerr.ErrNotReplicated, which every service answers as UNAVAILABLE
// STORE_NOT_REPLICATED with RetryInfo; every acknowledged write is
// idempotent by its id, so the retry is safe.
package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/storeerr"
)

// Policy is how many replicas must have a write, and how long to wait.
type Policy struct {
	Replicas int           // 0: writes are not confirmed
	Timeout  time.Duration // bound on each WAIT (the call's own deadline may be shorter)
}

// markerSuffix names the marker key written (and deleted again) next to each
// confirmed key, in its hash slot.
const markerSuffix = "agentplane:replicated"

// Require makes rdb confirm its writes by p; with p.Replicas 0 it does nothing.
// On a Cluster the hook sits on each node's client (where go-redis runs the
// node's commands, pipelines and WATCH transactions), so it confirms on the
// very master that took the write.
func Require(rdb redis.UniversalClient, p Policy) {
	if p.Replicas <= 0 {
		return
	}
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		c.OnNewNode(func(node *redis.Client) { node.AddHook(&hook{policy: p, node: node, cluster: true}) })
	case *redis.Client: // one node, or Sentinel's client of the current master
		c.AddHook(&hook{policy: p, node: c})
	default:
		panic(fmt.Sprintf("replication: unsupported client %T", rdb))
	}
}

type hook struct {
	policy  Policy
	node    *redis.Client // the client the hook is on
	cluster bool          // node is a Cluster node: keyless writes cannot be placed
}

// confirming marks the context of the hook's own marker writes, which must
// not be confirmed again.
type confirming struct{}

func (h *hook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err != nil || ctx.Value(confirming{}) != nil {
			return err
		}
		return h.confirm(ctx, []redis.Cmder{cmd})
	}
}

func (h *hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		if ctx.Value(confirming{}) != nil {
			return err
		}
		// A pipeline may fail in part; what did write is confirmed all the same.
		if cerr := h.confirm(ctx, cmds); cerr != nil {
			return cerr
		}
		return err
	}
}

// confirm waits for the replicas of the node if cmds wrote to it. On failure
// every command that had succeeded fails with the error, so a caller that
// checks any of them (or the pipeline) sees it.
func (h *hook) confirm(ctx context.Context, cmds []redis.Cmder) error {
	key, wrote := "", false
	for _, cmd := range cmds {
		if k, w := writtenKey(cmd); w && (k != "" || !h.cluster) {
			key, wrote = k, true
			break
		}
	}
	if !wrote {
		return nil
	}
	err := h.wait(ctx, key)
	if err == nil {
		return nil
	}
	err = fmt.Errorf("%w: %w", storeerr.ErrNotReplicated, err)
	for _, cmd := range cmds {
		if cmd.Err() == nil {
			cmd.SetErr(err)
		}
	}
	return err
}

// wait writes a marker in key's slot on the node and WAITs for the policy's
// replicas there; the marker is deleted in the same round trip.
func (h *hook) wait(ctx context.Context, key string) error {
	timeout := h.policy.Timeout
	if d, ok := ctx.Deadline(); ok && time.Until(d) < timeout {
		timeout = time.Until(d)
	}
	if timeout < time.Millisecond {
		return errors.New("no time left to wait for replicas")
	}
	marker, err := markerFor(key)
	if err != nil {
		return err
	}
	var acked *redis.IntCmd
	_, err = h.node.Pipelined(context.WithValue(ctx, confirming{}, true), func(p redis.Pipeliner) error {
		p.Set(ctx, marker, "", 0)
		p.Del(ctx, marker)
		acked = redis.NewIntCmd(ctx, "wait", h.policy.Replicas, timeout.Milliseconds())
		_ = p.Process(ctx, acked)
		return nil
	})
	if err != nil {
		return err
	}
	if n := acked.Val(); n < int64(h.policy.Replicas) {
		return fmt.Errorf("%d of %d replicas acknowledged within %s", n, h.policy.Replicas, timeout)
	}
	return nil
}

// markerFor is a key in key's hash slot: "{tag}agentplane:replicated", where
// tag is what Redis hashes of key (its {hash tag}, or all of it).
func markerFor(key string) (string, error) {
	tag := key
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			tag = key[i+1 : i+1+j]
		}
	}
	if strings.ContainsRune(tag, '}') {
		return "", errors.New("key has no hash tag and contains '}': no marker can share its slot")
	}
	return "{" + tag + "}" + markerSuffix, nil
}

// writtenKey reports whether cmd wrote (it succeeded and is a write command)
// and the first key it wrote ("" for a keyless write such as FLUSHALL).
func writtenKey(cmd redis.Cmder) (string, bool) {
	if cmd.Err() != nil {
		return "", false // failed, or redis.Nil: nothing written
	}
	name := strings.ToLower(cmd.Name())
	if !writes[name] {
		return "", false
	}
	args := cmd.Args()
	pos := 1
	switch name {
	case "eval", "evalsha", "fcall":
		pos = 3 // EVAL script numkeys key...
		if len(args) > 2 && fmt.Sprint(args[2]) == "0" {
			return "", true
		}
	case "xgroup":
		pos = 2 // XGROUP CREATE key ...
	case "blmpop", "bzmpop":
		pos = 3 // BLMPOP timeout numkeys key...
	case "lmpop", "zmpop":
		pos = 2 // LMPOP numkeys key...
	case "flushall", "flushdb", "swapdb", "function":
		return "", true
	}
	if pos >= len(args) {
		return "", true
	}
	return fmt.Sprint(args[pos]), true
}

// writes are the commands that change data: Redis' @write category
// (COMMAND LIST FILTERBY ACLCAT write, checked against redis-server by the
// tests) and the script calls, which may write.
var writes = func() map[string]bool {
	m := map[string]bool{}
	for name := range strings.FieldsSeq(`append bitfield bitop blmove blmpop blpop brpop brpoplpush bzmpop
		bzpopmax bzpopmin copy decr decrby del expire expireat flushall flushdb function geoadd georadius
		georadiusbymember geosearchstore getdel getex getset hdel hincrby hincrbyfloat hmset hset hsetnx
		incr incrby incrbyfloat linsert lmove lmpop lpop lpush lpushx lrem lset ltrim migrate move mset
		msetnx persist pexpire pexpireat pfadd pfdebug pfmerge psetex rename renamenx restore restore-asking
		rpop rpoplpush rpush rpushx sadd sdiffstore set setbit setex setnx setrange sinterstore smove sort
		spop srem sunionstore swapdb unlink xack xadd xautoclaim xclaim xdel xgroup xreadgroup xsetid xtrim
		zadd zdiffstore zincrby zinterstore zmpop zpopmax zpopmin zrangestore zrem zremrangebylex
		zremrangebyrank zremrangebyscore zunionstore
		eval evalsha fcall`) {
		m[name] = true
	}
	return m
}()

// Confirm waits, by rdb's policy, until the replicas of key's master have
// everything that master has: for an idempotent replay that acknowledges an
// earlier attempt's write without writing again. It deletes the (absent)
// marker of key's slot, a write the hook confirms; without a policy it is
// one cheap command.
func Confirm(ctx context.Context, rdb redis.Cmdable, key string) error {
	marker, err := markerFor(key)
	if err != nil {
		return err
	}
	return rdb.Del(ctx, marker).Err()
}
