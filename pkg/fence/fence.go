// Package fence grants leases with fencing tokens on Redis and guards writes
// with them.
//
// A lease alone cannot stop a paused or partitioned former holder from
// writing: it may wake up after its lease expired and another process took
// over. Every lease therefore carries a token that is strictly greater than
// every token granted before for the same resource, and every protected
// write runs in one Lua script that first checks that its token is still the
// newest one granted. A stale holder's write is rejected with ErrStaleToken.
//
// Tokens are max(previous+1, Redis TIME in microseconds), so they keep
// increasing even when Redis loses the counter (FLUSHALL, a restart without
// persistence, a failover to a replica that missed the last write).
//
// Keys: fence:{resource}:token (newest token granted, no expiry) and
// fence:{resource}:lease ("<token>:<owner>", with the lease TTL). Guarded
// keys of callers must carry the same {resource} hash tag (see Key), so every
// script touches one hash slot and works on Redis Cluster.
package fence

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	// ErrLeaseHeld means another owner holds the lease.
	ErrLeaseHeld = errors.New("fence: lease held by another owner")
	// ErrLeaseLost means the lease expired, was released, or was taken
	// over; the caller must stop acting as the holder.
	ErrLeaseLost = errors.New("fence: lease lost")
	// ErrStaleToken means a newer token was granted for the resource (or
	// the token is zero, malformed, or unknown to Redis): the write was not
	// applied.
	ErrStaleToken = errors.New("fence: stale fencing token")
	// ErrInvalid reports a bad argument (resource name, owner, TTL, key).
	ErrInvalid = errors.New("fence: invalid argument")
)

// Error strings returned by the scripts; mapped to the errors above.
const (
	staleReply = "FENCE_STALE"
	lostReply  = "FENCE_LOST"
	heldReply  = "FENCE_HELD"
)

// TokenKey is the key holding the newest token granted for resource.
func TokenKey(resource string) string { return "fence:{" + resource + "}:token" }

// LeaseKey is the key holding the current lease of resource.
func LeaseKey(resource string) string { return "fence:{" + resource + "}:lease" }

// Key builds a key for caller data guarded by resource's token: it carries
// the {resource} hash tag, so it lands in the same Redis Cluster slot as the
// token key. Prefix it with the service's own prefix, e.g.
// "sbx:" + fence.Key(id, "state") = "sbx:{id}:state".
func Key(resource, suffix string) string { return "{" + resource + "}:" + suffix }

// HashTag returns the part of key Redis Cluster hashes: the text between the
// first '{' and the next '}' if it is non-empty, else the whole key.
func HashTag(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return key
	}
	end := strings.IndexByte(key[open+1:], '}')
	if end <= 0 {
		return key
	}
	return key[open+1 : open+1+end]
}

// ValidateResource checks that a resource name can be used as a hash tag.
func ValidateResource(resource string) error {
	if resource == "" || strings.ContainsAny(resource, "{}") {
		return fmt.Errorf("%w: resource %q must be non-empty and contain no braces", ErrInvalid, resource)
	}
	return nil
}

// acquireScript grants the lease if it is free. The token is
// max(last+1, TIME in µs): the TIME floor keeps tokens increasing when the
// token key was lost. It does the fewest calls for the common case: it
// claims the lease with SET NX PX using the TIME token, then swaps the
// token in with SET GET; only if the old token was not below TIME (more
// than one grant per µs, a clock step back, a token restored from a faster
// clock) does it rewrite both with last+1. A held lease costs TIME and one
// SET and changes nothing; a token key of the wrong type undoes the claim,
// so a failed acquire leaves nothing behind.
//
// The hot path does no number conversion (string.format alone cost more
// server CPU than a GET): TIME's seconds and zero-padded µs concatenate to
// the canonical decimal token (the µs need no padding 9 times in 10, and
// skipping the two padding strings then saves ≈ 0.6 µs of Redis time), and
// canonical decimals compare by length, then bytewise. Only a stored token that is not clearly below goes through
// tonumber; one that does not parse (malformed) counts as absent, as a
// missing one does. Lua numbers are doubles, exact up to 2^53 (year 2255 in
// µs), and '%.0f' keeps the stored form canonical (tostring would print
// 1.7e+15). KEYS: token, lease. ARGV: owner, ttl ms.
var acquireScript = newLua(`
local t = redis.call('TIME')
local s = #t[2] == 6 and t[1] .. t[2] or t[1] .. string.sub('00000' .. t[2], -6)
if not redis.call('SET', KEYS[2], s .. ':' .. ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.error_reply('`+heldReply+`')
end
local last = redis.pcall('SET', KEYS[1], s, 'GET')
if type(last) == 'table' then -- token key of another type: undo the claim
  redis.call('DEL', KEYS[2])
  return last
end
if last and (#last > #s or (#last == #s and last >= s)) then
  local n = tonumber(last)
  if n and n >= tonumber(s) then
    s = string.format('%.0f', n + 1)
    redis.call('SET', KEYS[1], s)
    redis.call('SET', KEYS[2], s .. ':' .. ARGV[1], 'PX', ARGV[2])
  end
end
return s
`, true) // once: a repeat would find its own grant and report the lease held

// renewScript extends the lease only if it still holds exactly this
// token:owner; an expired lease is never recreated. KEYS: lease. ARGV:
// "token:owner", ttl ms.
var renewScript = newLua(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('`+lostReply+`')
end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
`, false) // safe to repeat

// reclaimScript is renewScript for a holder that lost contact with Redis
// (renewals it could not confirm): it extends the lease if it still holds
// token:owner, and recreates it if it expired meanwhile while the token key
// still holds this token, that is, nobody was granted the resource since
// (every grant moves the token key). Anything else is lost. KEYS: lease,
// token. ARGV: "token:owner", ttl ms, token.
var reclaimScript = newLua(`
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not v and redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return redis.error_reply('`+lostReply+`')
`, false) // safe to repeat

// releaseScript deletes the lease only if it holds exactly this token:owner.
// The token key stays: it is the floor for the next grant.
var releaseScript = newLua(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('`+lostReply+`')
end
return redis.call('DEL', KEYS[1])
`, true) // once: a repeat would report the released lease lost

// guardPrelude is the token check every guarded script starts with. It
// compares strings: the stored token is canonical decimal, so a zero,
// malformed, older or unknown (missing key after data loss) token never
// matches and the script stops before writing. KEYS[1]: token key,
// ARGV[1]: token.
const guardPrelude = `
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('` + staleReply + `')
end
`

// mapErr turns script error replies into the package's errors.
func mapErr(err error) error {
	if err == nil {
		return nil
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		// Redis 7 prefixes error_reply messages with "ERR ".
		switch msg := strings.TrimPrefix(rerr.Error(), "ERR "); {
		case strings.HasPrefix(msg, staleReply):
			return ErrStaleToken
		case strings.HasPrefix(msg, lostReply):
			return ErrLeaseLost
		case strings.HasPrefix(msg, heldReply):
			return ErrLeaseHeld
		}
	}
	return fmt.Errorf("fence: redis: %w", err)
}

// Lease is a granted lease. It is a value the holder keeps; the lease in
// Redis may be lost at any time (check the errors of Renew and Guard).
type Lease struct {
	Resource string
	Owner    string
	Token    uint64
	TTL      time.Duration
	rdb      redis.Scripter
	keys     leaseKeys
}

// leaseKeys caches the strings Acquire built, so renew, release and guarded
// writes do not rebuild them on every call. They are used only while the
// exported fields still match (a caller may copy a Lease and change them).
type leaseKeys struct {
	resource string
	token    uint64
	tokenKey string
	leaseKey string
	tokenStr string
	tokenArg any // tokenStr, boxed once for the ARGV of every guarded write
}

func (l *Lease) cached() bool { return l.keys.resource == l.Resource && l.keys.token == l.Token }

func (l *Lease) tokenKey() string {
	if l.keys.resource == l.Resource {
		return l.keys.tokenKey
	}
	return TokenKey(l.Resource)
}

func (l *Lease) leaseKey() string {
	if l.keys.resource == l.Resource {
		return l.keys.leaseKey
	}
	return LeaseKey(l.Resource)
}

func (l *Lease) tokenArg() any {
	if l.cached() {
		return l.keys.tokenArg
	}
	return strconv.FormatUint(l.Token, 10)
}

func (l *Lease) tokenString() string {
	if l.cached() {
		return l.keys.tokenStr
	}
	return strconv.FormatUint(l.Token, 10)
}

func checkTTL(ttl time.Duration) error {
	if ttl < time.Millisecond {
		return fmt.Errorf("%w: ttl %v must be at least 1ms", ErrInvalid, ttl)
	}
	return nil
}

// Acquire grants the lease of resource to owner for ttl if nobody holds it,
// else returns ErrLeaseHeld. It does not wait or retry. rdb is a
// *redis.Client, *redis.ClusterClient or any redis.Scripter.
func Acquire(ctx context.Context, rdb redis.Scripter, resource, owner string, ttl time.Duration) (*Lease, error) {
	if err := ValidateResource(resource); err != nil {
		return nil, err
	}
	if owner == "" {
		return nil, fmt.Errorf("%w: empty owner", ErrInvalid)
	}
	if err := checkTTL(ttl); err != nil {
		return nil, err
	}
	tk, lk := TokenKey(resource), LeaseKey(resource)
	s, err := run(ctx, rdb, acquireScript, []string{tk, lk}, owner, ttl.Milliseconds()).Text()
	if err != nil {
		return nil, fmt.Errorf("acquire %s: %w", resource, mapErr(err))
	}
	tok, err := strconv.ParseUint(s, 10, 64)
	if err != nil || tok == 0 {
		return nil, fmt.Errorf("acquire %s: bad token %q from redis", resource, s)
	}
	return &Lease{Resource: resource, Owner: owner, Token: tok, TTL: ttl, rdb: rdb,
		keys: leaseKeys{resource: resource, token: tok, tokenKey: tk, leaseKey: lk, tokenStr: s, tokenArg: s}}, nil
}

// value is the lease's content in Redis, "<token>:<owner>", built from the
// exported fields so a copied and altered Lease never matches by accident.
func (l *Lease) value() string { return l.tokenString() + ":" + l.Owner }

// Renew extends the lease to TTL from now if it is still this owner's with
// this token; otherwise it returns ErrLeaseLost and changes nothing.
func (l *Lease) Renew(ctx context.Context) error {
	err := run(ctx, l.rdb, renewScript, []string{l.leaseKey()}, l.value(), l.TTL.Milliseconds()).Err()
	if err != nil {
		return fmt.Errorf("renew %s: %w", l.Resource, mapErr(err))
	}
	return nil
}

// reclaim is Renew for a holder that could not confirm its renewals: it
// also recreates the lease if it expired while no one else was granted it
// (reclaimScript).
func (l *Lease) reclaim(ctx context.Context) error {
	err := run(ctx, l.rdb, reclaimScript, []string{l.leaseKey(), l.tokenKey()}, l.value(), l.TTL.Milliseconds(), l.tokenArg()).Err()
	if err != nil {
		return fmt.Errorf("reclaim %s: %w", l.Resource, mapErr(err))
	}
	return nil
}

// Release gives the lease up. ErrLeaseLost means it was no longer ours (and
// nothing was changed). The token floor stays, so tokens keep increasing.
func (l *Lease) Release(ctx context.Context) error {
	err := run(ctx, l.rdb, releaseScript, []string{l.leaseKey()}, l.value()).Err()
	if err != nil {
		return fmt.Errorf("release %s: %w", l.Resource, mapErr(err))
	}
	return nil
}

// Guard runs ops atomically if the lease's token is still the newest one.
func (l *Lease) Guard(ctx context.Context, ops ...Op) error {
	return guard(ctx, l.rdb, l.Resource, l.Token, l.tokenKey(), l.tokenArg(), ops)
}
