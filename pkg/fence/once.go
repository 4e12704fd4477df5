package fence

import (
	"context"
	"errors"

	"github.com/redis/go-redis/v9"
)

// luaScript is a script with its source. once marks a script that is not
// safe to repeat: go-redis resends a command after a read timeout (and after
// other errors its shouldRetry accepts), when the script may already have
// run. A repeated acquire would then report the lease held by its own grant,
// a repeated compare-and-set a conflict after it applied. A once script goes
// out as a command whose NoRetry is true, so go-redis never sends it again;
// the caller sees the error instead. Renewals and the guarded writes of Op
// (SET, HSET, DEL, PEXPIRE after the token check) are safe to repeat and
// keep go-redis' retries.
type luaScript struct {
	*redis.Script
	src  string
	once bool
}

func newLua(src string, once bool) *luaScript {
	return &luaScript{Script: redis.NewScript(src), src: src, once: once}
}

// processor sends one command: clients and pipelines.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// onceCmd is a command go-redis must not retry (single commands and every
// pipeline holding one).
type onceCmd struct{ *redis.Cmd }

func (onceCmd) NoRetry() bool { return true }

// evalCmd builds EVALSHA (or EVAL with the source) as go-redis' own
// Script.Run does, first key at position 3 for Cluster routing.
func (s *luaScript) evalCmd(ctx context.Context, sha bool, keys []string, args []any) *redis.Cmd {
	a := make([]any, 3, 3+len(keys)+len(args))
	a[0], a[1], a[2] = "eval", s.src, len(keys)
	if sha {
		a[0], a[1] = "evalsha", s.Hash()
	}
	for _, k := range keys {
		a = append(a, k)
	}
	a = append(a, args...)
	cmd := redis.NewCmd(ctx, a...)
	if len(keys) > 0 {
		cmd.SetFirstKeyPos(3)
	}
	return cmd
}

// queueOnce queues EVALSHA of a once script on a pipeline.
func (s *luaScript) queueOnce(ctx context.Context, p processor, keys []string, args []any) *redis.Cmd {
	cmd := s.evalCmd(ctx, true, keys, args)
	_ = p.Process(ctx, onceCmd{cmd})
	return cmd
}

// runOnce sends a once script: EVALSHA, then EVAL when the server does not
// know the script (NOSCRIPT: it did not run, so sending again is safe).
func (s *luaScript) runOnce(ctx context.Context, p processor, keys []string, args []any) *redis.Cmd {
	cmd := s.queueOnce(ctx, p, keys, args)
	if isNoScript(cmd.Err()) {
		cmd = s.evalCmd(ctx, false, keys, args)
		_ = p.Process(ctx, onceCmd{cmd})
	}
	return cmd
}

// runScript runs s on c, once scripts without go-redis' retries.
func runScript(ctx context.Context, c redis.Scripter, s *luaScript, keys []string, args []any) *redis.Cmd {
	if p, ok := c.(processor); ok && s.once {
		return s.runOnce(ctx, p, keys, args)
	}
	return s.Run(ctx, c, keys, args...)
}

func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT"))
}
