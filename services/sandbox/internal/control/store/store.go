// Package store keeps the driver's sandbox state in Redis (the wrapper
// leases are internal/control/leasestore's, the reconciler's store). Every key of a sandbox carries
// the {sbx/<sandbox-id>} hash tag, the owner lease's fence resource
// (ownership.Resource), so each write is one guarded script on one slot:
// nothing is written unless the writer still holds the newest owner token.
//
//	sbx:{sbx/id}:meta      hash: allocation_id
//	sbx:{sbx/id}:routes    hash: session id → Route JSON
//	sbx:{sbx/id}:scopes    hash: directory → scope.Scope JSON
//	sbx:{sbx/id}:wrappers  hash: instance id → Wrapper JSON (launch credential digest only)
//	sbx:{sbx/id}:slots     hash: runtime key → KeyAllocation JSON (allocation state)
//	sbx:{sbx/id}:wrapper-leases  hash: runtime key → wrapper lease (internal/control/leasestore)
//	sbx:{sbx/id}:egress    string: EgressWindow JSON, expiring when the window ends
//	sbx:{sbx/id}:tenant    string: the tenant the sandbox belongs to (internal/control/tenancy; set once, never fenced, never changed)
//	sbx:index          set of sandbox ids with state (scanned for takeover; not fenced)
package store

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/pkg/fence"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/ownership"
	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/scope"
)

// IndexKey lists sandboxes that may need an owner.
const IndexKey = "sbx:index"

// Key returns a sandbox key.
func Key(sandboxID, suffix string) string {
	return "sbx:" + fence.Key(ownership.Resource(sandboxID), suffix)
}

// Route states (internal/control/route).
const (
	RouteUnknown      = route.Unknown
	RoutePreparing    = route.Preparing
	RouteReady        = route.Ready
	RouteReconnecting = route.Reconnecting
	RouteFailed       = route.Failed
	RouteReleased     = route.Released // kept until the runtime key's absence is verified
)

// Route is the sandbox's view of one session's route: its lifecycle
// (route.Route, changed only by route.Apply; the embedded fields keep the
// record's JSON keys) and what preparing it needs.
type Route struct {
	SessionID string `json:"session_id"`
	route.Route
	RepoURL          string `json:"repo_url,omitempty"`
	RepoRef          string `json:"repo_ref,omitempty"`
	RepoDepth        uint32 `json:"repo_depth,omitempty"`
	GitCredentialRef string `json:"git_credential_ref,omitempty"`
	UserID           string `json:"user_id,omitempty"`
	OrgID            string `json:"org_id,omitempty"`
	CredentialRef    string `json:"credential_ref,omitempty"`
	CredentialClass  string `json:"credential_class,omitempty"`
	Agent            Agent  `json:"agent,omitzero"`
	// Egress is the session's egress policy and EgressVersion its version
	// (an older version never replaces a newer one).
	Egress        egresspolicy.Policy `json:"egress,omitzero"`
	EgressVersion uint64              `json:"egress_version,omitempty"`
	Updated       time.Time           `json:"updated"`
}

// Agent is a route's agent: the resolved profile and model, and the tool
// kinds whose permission requests are rejected.
type Agent struct {
	Profile         string   `json:"profile,omitempty"`
	Model           string   `json:"model,omitempty"`
	RejectToolKinds []string `json:"reject_tool_kinds,omitempty"`
}

// Wrapper is one launched wrapper; the launch credential is kept as its
// SHA-256 digest, bound to the sandbox and the allocation.
type Wrapper struct {
	Instance   string `json:"instance"`
	RuntimeKey string `json:"runtime_key"`
	Allocation string `json:"allocation"`
	Generation uint64 `json:"generation"`
	FenceToken uint64 `json:"fence_token"`
	CredDigest []byte `json:"cred_digest"`
}

// KeyAllocation is the allocation of one runtime key: the directory its
// wrapper serves and the allocation machine's state (internal/control/allocation),
// kept in the sandbox's "slots" hash.
type KeyAllocation struct {
	RuntimeKey string                `json:"runtime_key"`
	Directory  string                `json:"directory"`
	Alloc      allocation.Allocation `json:"alloc"`
}

// Snapshot is everything stored of a sandbox.
type Snapshot struct {
	AllocationID   string
	Routes         map[string]*Route
	Scopes         map[string]*scope.Scope
	Wrappers       map[string]*Wrapper
	KeyAllocations map[string]*KeyAllocation
	// Unparsable names the records skipped because they did not parse
	// ("routes/<field>", ...), so the caller can tell an operator.
	Unparsable []string
}

// Writer runs guarded writes (the sandbox's Owner).
type Writer interface {
	Guard(ctx context.Context, ops ...fence.Op) error
	Token() uint64
}

// Load reads a sandbox. A record that does not parse is skipped and named in
// Unparsable (its route is re-prepared by the session service; a wrapper it
// described can no longer authenticate and is stopped by its lease).
func Load(ctx context.Context, rdb redis.UniversalClient, sandboxID string) (Snapshot, error) {
	s := Snapshot{Routes: map[string]*Route{}, Scopes: map[string]*scope.Scope{}, Wrappers: map[string]*Wrapper{}, KeyAllocations: map[string]*KeyAllocation{}}
	alloc, err := rdb.HGet(ctx, Key(sandboxID, "meta"), "allocation_id").Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return s, err
	}
	s.AllocationID = alloc
	if err := loadHash(ctx, rdb, sandboxID, "routes", s.Routes, &s.Unparsable); err != nil {
		return s, err
	}
	if err := loadHash(ctx, rdb, sandboxID, "scopes", s.Scopes, &s.Unparsable); err != nil {
		return s, err
	}
	if err := loadHash(ctx, rdb, sandboxID, "wrappers", s.Wrappers, &s.Unparsable); err != nil {
		return s, err
	}
	return s, loadHash(ctx, rdb, sandboxID, "slots", s.KeyAllocations, &s.Unparsable)
}

func loadHash[T any](ctx context.Context, rdb redis.UniversalClient, sandboxID, kind string, into map[string]*T, unparsable *[]string) error {
	m, err := rdb.HGetAll(ctx, Key(sandboxID, kind)).Result()
	if err != nil {
		return err
	}
	for k, v := range m {
		var t T
		if json.Unmarshal([]byte(v), &t) != nil {
			*unparsable = append(*unparsable, kind+"/"+k)
			continue
		}
		into[k] = &t
	}
	return nil
}

// AllocationID reads a sandbox's current allocation ("" when none).
func AllocationID(ctx context.Context, rdb redis.UniversalClient, sandboxID string) (string, error) {
	v, err := rdb.HGet(ctx, Key(sandboxID, "meta"), "allocation_id").Result()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	return v, err
}

// Index records that sandboxID has state (an owner must drive it).
func Index(ctx context.Context, rdb redis.UniversalClient, sandboxID string) error {
	return rdb.SAdd(ctx, IndexKey, sandboxID).Err()
}

// Indexed lists sandboxes with state.
func Indexed(ctx context.Context, rdb redis.UniversalClient) ([]string, error) {
	return rdb.SMembers(ctx, IndexKey).Result()
}

// PutMeta writes the allocation id.
func PutMeta(ctx context.Context, w Writer, sandboxID, allocationID string) error {
	return w.Guard(ctx, fence.HSet(Key(sandboxID, "meta"), "allocation_id", allocationID, "owner_token", w.Token()))
}

// PutRoute writes a route.
func PutRoute(ctx context.Context, w Writer, sandboxID string, r *Route) error {
	return putJSON(ctx, w, Key(sandboxID, "routes"), r.SessionID, r)
}

// PutScope writes a scope.
func PutScope(ctx context.Context, w Writer, sc *scope.Scope) error {
	return putJSON(ctx, w, Key(sc.SandboxID, "scopes"), sc.Directory, sc)
}

// PutWrapper writes a wrapper record (before its launch).
func PutWrapper(ctx context.Context, w Writer, sandboxID string, wr *Wrapper) error {
	return putJSON(ctx, w, Key(sandboxID, "wrappers"), wr.Instance, wr)
}

// PutKeyAllocation writes a runtime key's allocation.
func PutKeyAllocation(ctx context.Context, w Writer, sandboxID string, s *KeyAllocation) error {
	return putJSON(ctx, w, Key(sandboxID, "slots"), s.RuntimeKey, s)
}

// PutKeyAllocations writes several slots in one guarded write.
func PutKeyAllocations(ctx context.Context, w Writer, sandboxID string, slots []*KeyAllocation) error {
	if len(slots) == 0 {
		return nil
	}
	args := make([]any, 0, 2*len(slots))
	for _, s := range slots {
		b, err := json.Marshal(s)
		if err != nil {
			return err
		}
		args = append(args, s.RuntimeKey, b)
	}
	return w.Guard(ctx, fence.HSet(Key(sandboxID, "slots"), args...))
}

// DeleteRoute removes a route record.
func DeleteRoute(ctx context.Context, w Writer, rdb redis.Scripter, sandboxID, sessionID string) error {
	return hdel.Run(ctx, rdb, ownership.Resource(sandboxID), w.Token(), []string{Key(sandboxID, "routes")}, sessionID).Err()
}

var hdel = fence.NewGuardedScript(`return redis.call('HDEL', KEYS[2], ARGV[2])`)

// hdelEach removes fields of up to three hashes: KEYS[2..4], and ARGV[2..4]
// the number of fields of each, then the fields in order.
var hdelEach = fence.NewGuardedScript(`
local at = 5
for i = 2, #KEYS do
  local n = tonumber(ARGV[i])
  for j = 1, n do redis.call('HDEL', KEYS[i], ARGV[at]); at = at + 1 end
end
return 1
`)

// ForgetKey removes the records of a runtime key whose last session is gone
// (DESIGN.md 3.5: nothing outlives its session): its slot, the records of
// its wrapper instances and, when scopeDir is set, that directory's scope.
// A hash left empty is gone with its last field.
func ForgetKey(ctx context.Context, w Writer, rdb redis.Scripter, sandboxID, runtimeKey string, instances []string, scopeDir string) error {
	keys := []string{Key(sandboxID, "slots"), Key(sandboxID, "wrappers"), Key(sandboxID, "scopes")}
	var dirs []string
	if scopeDir != "" {
		dirs = []string{scopeDir}
	}
	args := []any{1, len(instances), len(dirs), runtimeKey}
	for _, i := range instances {
		args = append(args, i)
	}
	for _, d := range dirs {
		args = append(args, d)
	}
	return hdelEach.Run(ctx, rdb, ownership.Resource(sandboxID), w.Token(), keys, args...).Err()
}

// EgressWindow is the sandbox's egress byte window as its owner last saved
// it: when it started and what the sandbox's connections carried in it.
type EgressWindow struct {
	Start time.Time `json:"start"`
	Used  int64     `json:"used"`
}

// LoadEgressWindow reads the saved window; the zero window when none is
// saved (never, or it ended and expired).
func LoadEgressWindow(ctx context.Context, rdb redis.UniversalClient, sandboxID string) (EgressWindow, error) {
	var w EgressWindow
	b, err := rdb.Get(ctx, Key(sandboxID, "egress")).Bytes()
	if errors.Is(err, redis.Nil) {
		return w, nil
	}
	if err != nil {
		return w, err
	}
	// A record that does not parse would reset the window: say so instead.
	return w, json.Unmarshal(b, &w)
}

// PutEgressWindow saves the window until ends, when it no longer counts.
func PutEgressWindow(ctx context.Context, w Writer, sandboxID string, win EgressWindow, ends time.Time) error {
	ttl := time.Until(ends)
	if ttl < time.Millisecond {
		return nil // over: nothing for a next owner to go on with
	}
	b, err := json.Marshal(win)
	if err != nil {
		return err
	}
	return w.Guard(ctx, fence.Set(Key(sandboxID, "egress"), b, ttl))
}

func putJSON(ctx context.Context, w Writer, key, field string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return w.Guard(ctx, fence.HSet(key, field, b))
}

// ClaimTenant records tenant as the sandbox's tenant unless one is recorded
// already, and returns the recorded one: one script, so of two tenants racing
// to claim a sandbox exactly one wins. Not fenced: the binding is not the
// owner's state, any replica may record it, and nothing ever changes it.
func ClaimTenant(ctx context.Context, rdb redis.Scripter, sandboxID, tenant string) (string, error) {
	return claimTenant.Run(ctx, rdb, []string{Key(sandboxID, "tenant")}, tenant).Text()
}

var claimTenant = redis.NewScript(`local v = redis.call('GET', KEYS[1])
if v then return v end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]`)

// LoadTenant reads the sandbox's recorded tenant ("" when none is).
func LoadTenant(ctx context.Context, rdb redis.UniversalClient, sandboxID string) (string, error) {
	v, err := rdb.Get(ctx, Key(sandboxID, "tenant")).Result()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	return v, err
}

// RouteTenants returns the (org, user) of every stored route of the sandbox
// that names one, whether or not the route parses otherwise: the tenants
// of a sandbox recorded before sandboxes had one.
func RouteTenants(ctx context.Context, rdb redis.UniversalClient, sandboxID string) ([][2]string, error) {
	m, err := rdb.HGetAll(ctx, Key(sandboxID, "routes")).Result()
	if err != nil {
		return nil, err
	}
	var out [][2]string
	for _, v := range m {
		var r struct {
			OrgID  string `json:"org_id"`
			UserID string `json:"user_id"`
		}
		if json.Unmarshal([]byte(v), &r) == nil && (r.OrgID != "" || r.UserID != "") {
			out = append(out, [2]string{r.OrgID, r.UserID})
		}
	}
	return out, nil
}
