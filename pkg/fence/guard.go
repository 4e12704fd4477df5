package fence

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Op is one write of a guarded batch; build it with Set, HSet, Del or
// PExpire. Every key must carry the resource's hash tag (see Key).
type Op struct {
	cmd  string
	key  string   // first key; one-key ops need no slice
	more []string // further keys (Del)
	args []any
}

// Set is SET key value, with PX ttl when ttl > 0.
func Set(key string, value any, ttl time.Duration) Op {
	if ttl > 0 {
		return Op{cmd: "SET", key: key, args: []any{value, "PX", ttl.Milliseconds()}}
	}
	return Op{cmd: "SET", key: key, args: []any{value}}
}

// HSet is HSET key field value [field value ...].
func HSet(key string, fieldValues ...any) Op {
	return Op{cmd: "HSET", key: key, args: fieldValues}
}

// Del is DEL key [key ...].
func Del(keys ...string) Op {
	if len(keys) == 0 {
		return Op{cmd: "DEL"} // rejected by Guard: no key
	}
	return Op{cmd: "DEL", key: keys[0], more: keys[1:]}
}

// PExpire is PEXPIRE key ttl.
func PExpire(key string, ttl time.Duration) Op {
	return Op{cmd: "PEXPIRE", key: key, args: []any{ttl.Milliseconds()}}
}

// opsScript applies a list of ops after the token check. ARGV after the
// token holds, per op: command, number of keys, number of args, args. Keys
// come in order from KEYS[2..]. Only the constructors above build ops, so
// the command set is fixed.
var opsScript = newOpsScript(`
local k, a = 2, 2
while a <= #ARGV do
  local argv = {ARGV[a]}
  local nk, na = tonumber(ARGV[a+1]), tonumber(ARGV[a+2])
  a = a + 3
  for _ = 1, nk do argv[#argv+1] = KEYS[k]; k = k + 1 end
  for _ = 1, na do argv[#argv+1] = ARGV[a]; a = a + 1 end
  redis.call(unpack(argv))
end
return 1
`)

// oneOpScripts apply a single one-key op after the token check, one script
// per command: the common guarded write, without the op loop and without
// the command name in ARGV (each argument costs Redis parsing and Lua
// table work). ARGV after the token: the command's args. They do two
// calls: the GET of the check and the write.
var oneOpScripts = map[string]*GuardedScript{
	"SET":     oneOpScript("SET"),
	"HSET":    oneOpScript("HSET"),
	"DEL":     oneOpScript("DEL"),
	"PEXPIRE": oneOpScript("PEXPIRE"),
}

func oneOpScript(cmd string) *GuardedScript {
	return newOpsScript(`
redis.call('` + cmd + `', KEYS[2], unpack(ARGV, 2))
return 1
`)
}

// Guard applies ops atomically, in one round trip, if token is the newest
// token granted for resource; otherwise nothing is written and it returns
// ErrStaleToken. A zero token fails without contacting Redis.
func Guard(ctx context.Context, rdb redis.Scripter, resource string, token uint64, ops ...Op) error {
	return guard(ctx, rdb, resource, token, TokenKey(resource), strconv.FormatUint(token, 10), ops)
}

// guard is Guard with the token key and token string already built (a
// Lease caches them): the guarded write is the hot path, so it builds its
// KEYS and ARGV once, without going through GuardedScript.Run.
func guard(ctx context.Context, rdb redis.Scripter, resource string, token uint64, tokenKey string, tokenArg any, ops []Op) error {
	if len(ops) == 0 {
		return fmt.Errorf("%w: no ops", ErrInvalid)
	}
	for _, op := range ops {
		if op.cmd == "" || op.key == "" {
			return fmt.Errorf("%w: empty op", ErrInvalid)
		}
	}
	if err := checkGuard(resource, token); err != nil {
		return err
	}
	nkeys, nargs := 1, 1
	for _, op := range ops {
		nkeys += 1 + len(op.more)
		nargs += 3 + len(op.args)
	}
	keys := make([]string, 0, nkeys)
	keys = append(keys, tokenKey)
	for _, op := range ops {
		keys = append(keys, op.key)
		keys = append(keys, op.more...)
	}
	if err := checkTags(resource, keys[1:]); err != nil {
		return err
	}
	args := make([]any, 0, nargs)
	args = append(args, tokenArg)
	script, one := oneOpScripts[ops[0].cmd]
	if one && len(ops) == 1 && len(ops[0].more) == 0 {
		args = append(args, ops[0].args...)
	} else {
		script = opsScript
		for _, op := range ops {
			args = append(args, cmdArg(op.cmd), 1+len(op.more), len(op.args))
			args = append(args, op.args...)
		}
	}
	return guardErr(resource, run(ctx, rdb, script.s, keys, args...).Err())
}

// cmdArg returns the command name as a constant interface value: boxing
// the op's string field would allocate on every guarded write.
func cmdArg(cmd string) any {
	switch cmd {
	case "SET":
		return "SET"
	case "HSET":
		return "HSET"
	case "DEL":
		return "DEL"
	case "PEXPIRE":
		return "PEXPIRE"
	}
	return cmd
}

func checkGuard(resource string, token uint64) error {
	if err := ValidateResource(resource); err != nil {
		return err
	}
	if token == 0 {
		return fmt.Errorf("guarded write %s: %w (zero token)", resource, ErrStaleToken)
	}
	return nil
}

func checkTags(resource string, keys []string) error {
	for _, k := range keys {
		if HashTag(k) != resource {
			return fmt.Errorf("%w: key %q lacks hash tag {%s}", ErrInvalid, k, resource)
		}
	}
	return nil
}

func guardErr(resource string, err error) error {
	if err == nil || errors.Is(err, redis.Nil) {
		return err
	}
	return fmt.Errorf("guarded write %s: %w", resource, mapErr(err))
}

// GuardedScript is a caller's Lua body that runs only after the token check,
// in the same script and round trip. In the body, KEYS[1] and ARGV[1] are
// the token key and token; the caller's keys start at KEYS[2] and its args
// at ARGV[2].
type GuardedScript struct{ s *luaScript }

// NewGuardedScript prepends the token check to body. go-redis never sends
// it twice (a caller's body, such as a compare-and-set, need not be safe to
// repeat): after a timeout the caller gets the error, and must read the
// state again to learn whether the script ran.
func NewGuardedScript(body string) *GuardedScript {
	return &GuardedScript{s: newLua(guardPrelude+body, true)}
}

// newOpsScript is a guarded script of Op writes (SET, HSET, DEL, PEXPIRE),
// safe to repeat, so go-redis' retries stay on.
func newOpsScript(body string) *GuardedScript {
	return &GuardedScript{s: newLua(guardPrelude+body, false)}
}

// Run runs the script with EVALSHA (falling back to EVAL once if Redis lost
// its script cache). keys must carry resource's hash tag. A stale, zero or
// unknown token gives ErrStaleToken in the returned Cmd.
func (g *GuardedScript) Run(ctx context.Context, rdb redis.Scripter, resource string, token uint64, keys []string, args ...any) *redis.Cmd {
	if err := checkGuard(resource, token); err != nil {
		return failedCmd(ctx, err)
	}
	if err := checkTags(resource, keys); err != nil {
		return failedCmd(ctx, err)
	}
	allKeys := make([]string, 0, len(keys)+1)
	allKeys = append(allKeys, TokenKey(resource))
	allKeys = append(allKeys, keys...)
	allArgs := make([]any, 0, len(args)+1)
	allArgs = append(allArgs, strconv.FormatUint(token, 10))
	allArgs = append(allArgs, args...)
	res := run(ctx, rdb, g.s, allKeys, allArgs...)
	if err := res.Err(); err != nil && !errors.Is(err, redis.Nil) {
		res.SetErr(guardErr(resource, err))
	}
	return res
}

func failedCmd(ctx context.Context, err error) *redis.Cmd {
	cmd := redis.NewCmd(ctx)
	cmd.SetErr(err)
	return cmd
}
