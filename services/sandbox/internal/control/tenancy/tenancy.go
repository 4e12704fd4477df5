// Package tenancy binds each sandbox to the tenant (org, user) that created
// it and answers whether a caller's tenant may name it (DESIGN.md 3.3
// "Tenancy").
//
// A sandbox is bound once, atomically, by the first call that creates
// something in it (ClaimSandbox at CreateSession, Prepare); every other call
// only compares. An unbound sandbox belongs to nobody: comparing with it
// fails exactly as comparing with another tenant's does, so the answer never
// says whether a sandbox exists. A sandbox stored before tenancy existed is
// bound, on its first use, to the one tenant its routes name (decision 54).
package tenancy

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/services/sandbox/internal/control/store"
)

// ErrMismatch: the sandbox does not belong to the caller's tenant (or to
// no tenant yet, for a call that does not create).
var ErrMismatch = errors.New("the sandbox belongs to another tenant")

// Tenant is who a sandbox belongs to.
type Tenant struct {
	Org  string `json:"org"`
	User string `json:"user"`
}

func (t Tenant) encode() string {
	b, _ := json.Marshal(t) // two strings: never fails
	return string(b)
}

// Decide is the rule: only the recorded tenant may name the sandbox; no
// record, or one that does not parse, admits nobody.
func Decide(recorded string, caller Tenant) error {
	var t Tenant
	if recorded == "" || json.Unmarshal([]byte(recorded), &t) != nil || t != caller || t.Org == "" || t.User == "" {
		return ErrMismatch
	}
	return nil
}

// Inherited is the tenant of a sandbox stored before tenancy: the one
// (org, user) all its routes name; false when they name none or several (a
// sandbox two tenants already shared is bound by the next creating call).
func Inherited(routes [][2]string) (Tenant, bool) {
	if len(routes) == 0 {
		return Tenant{}, false
	}
	for _, r := range routes[1:] {
		if r != routes[0] {
			return Tenant{}, false
		}
	}
	return Tenant{Org: routes[0][0], User: routes[0][1]}, true
}

// Binder records and checks bindings in the sandbox store.
type Binder struct {
	Redis redis.UniversalClient
}

// Claim binds the sandbox to t when it is bound to no one, then checks that
// it belongs to t.
func (b Binder) Claim(ctx context.Context, sandboxID string, t Tenant) error {
	return b.bind(ctx, sandboxID, &t, t)
}

// Check checks that the sandbox belongs to t; it binds nothing (but the
// inherited tenant of a sandbox stored before tenancy).
func (b Binder) Check(ctx context.Context, sandboxID string, t Tenant) error {
	return b.bind(ctx, sandboxID, nil, t)
}

func (b Binder) bind(ctx context.Context, sandboxID string, claim *Tenant, caller Tenant) error {
	rec, err := store.LoadTenant(ctx, b.Redis, sandboxID)
	if err != nil {
		return err
	}
	if rec == "" {
		routes, err := store.RouteTenants(ctx, b.Redis, sandboxID)
		if err != nil {
			return err
		}
		cand, ok := Inherited(routes)
		if !ok && claim != nil {
			cand, ok = *claim, true
		}
		if !ok {
			return ErrMismatch
		}
		// Of two racing claims the script keeps the first; both compare
		// with what it kept.
		if rec, err = store.ClaimTenant(ctx, b.Redis, sandboxID, cand.encode()); err != nil {
			return err
		}
	}
	return Decide(rec, caller)
}
