package driver

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/ownership"
	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// KeyStatus describes one runtime key.
type KeyStatus struct {
	RuntimeKey string
	Lease      lease.Lease
	Members    []string
	Instance   string
	Alloc      allocation.Allocation
}

// SandboxStatus describes a sandbox.
type SandboxStatus struct {
	SandboxID    string
	Owner        string
	FenceToken   uint64
	AllocationID string
	Phase        allocation.Phase
	Keys         []KeyStatus
	Route        *store.Route
}

// Status reads a sandbox without taking it over: from memory when this
// replica owns it, else from Redis.
func (d *Driver) Status(ctx context.Context, sandboxID, sessionID string) (SandboxStatus, error) {
	owner, token, err := ownership.Current(ctx, d.cfg.Redis, sandboxID)
	if err != nil {
		return SandboxStatus{}, err
	}
	var snap store.Snapshot
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb != nil {
		sb.mu.Lock()
		snap = store.Snapshot{AllocationID: sb.allocationID, Routes: map[string]*store.Route{}, KeyAllocations: map[string]*store.KeyAllocation{}}
		for id, r := range sb.routes {
			c := *r
			snap.Routes[id] = &c
		}
		for k, s := range sb.keyAllocations {
			c := *s
			snap.KeyAllocations[k] = &c
		}
		sb.mu.Unlock()
	} else if snap, err = store.Load(ctx, d.cfg.Redis, sandboxID); err != nil {
		return SandboxStatus{}, err
	}
	st := SandboxStatus{SandboxID: sandboxID, Owner: owner, FenceToken: token, AllocationID: snap.AllocationID, Phase: allocation.Stopped}
	rank := map[allocation.Phase]int{allocation.Stopped: 0, allocation.Stopping: 1, allocation.Creating: 2, allocation.Starting: 3, allocation.Disconnected: 4, allocation.Connected: 5}
	for key, s := range snap.KeyAllocations {
		ks := KeyStatus{RuntimeKey: key, Instance: s.Alloc.Instance, Alloc: s.Alloc}
		if l, err := d.cfg.Wrappers.Lease(ctx, sandboxID, key); err == nil {
			ks.Lease = l
		}
		for id, r := range snap.Routes {
			if r.RuntimeKey == key && r.State != store.RouteReleased {
				ks.Members = append(ks.Members, id)
			}
		}
		sort.Strings(ks.Members)
		st.Keys = append(st.Keys, ks)
		if rank[s.Alloc.Phase] > rank[st.Phase] {
			st.Phase = s.Alloc.Phase
		}
	}
	sort.Slice(st.Keys, func(i, j int) bool { return st.Keys[i].RuntimeKey < st.Keys[j].RuntimeKey })
	if r := snap.Routes[sessionID]; sessionID != "" && r != nil {
		st.Route = r
	}
	return st, nil
}

// Scope returns a worktree scope (memory when owned, else Redis).
func (d *Driver) Scope(ctx context.Context, sandboxID, directory string) (*scope.Scope, error) {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	if sb != nil {
		sb.mu.Lock()
		defer sb.mu.Unlock()
		if sc := sb.scopes[directory]; sc != nil {
			c := *sc
			c.Members = map[string]string{}
			for k, v := range sc.Members {
				c.Members[k] = v
			}
			return &c, nil
		}
		return nil, ErrScopeNotFound
	}
	snap, err := store.Load(ctx, d.cfg.Redis, sandboxID)
	if err != nil {
		return nil, err
	}
	if sc := snap.Scopes[directory]; sc != nil {
		return sc, nil
	}
	return nil, ErrScopeNotFound
}

// ErrWorktreeRepoMismatch: the directory is bound to another repository.
var ErrWorktreeRepoMismatch = errors.New("the directory is bound to another repository")

// ErrAgentMismatch: the directory's shared runtime runs another agent.
var ErrAgentMismatch = errors.New("the directory's runtime runs another agent")

// CheckWorktree says whether a new session may join directory: a session of
// it that is not released binds the directory to its repository (the one
// its checkout was cloned from) and, under the worktree contract (one
// runtime per directory), to its agent profile and model. It reads without
// taking the sandbox over: memory when this replica owns it, else Redis.
func (d *Driver) CheckWorktree(ctx context.Context, sandboxID, directory, repoURL string, agent store.Agent) error {
	routes, err := d.routesOf(ctx, sandboxID)
	if err != nil {
		return err
	}
	asked, askedErr := d.cfg.Agents.Resolve(agent.Profile, agent.Model)
	for _, r := range routes {
		if r.Directory != directory || r.State == store.RouteReleased {
			continue
		}
		if repoURL != "" && r.RepoURL != "" && !strings.EqualFold(strings.TrimSuffix(r.RepoURL, "/"), strings.TrimSuffix(repoURL, "/")) {
			return fmt.Errorf("%w: a live session of %s works on %s", ErrWorktreeRepoMismatch, directory, r.RepoURL)
		}
		if r.Contract == scope.PerSession || askedErr != nil {
			continue
		}
		running, err := d.cfg.Agents.Resolve(r.Agent.Profile, r.Agent.Model)
		if err != nil {
			continue
		}
		if running.Profile != asked.Profile || running.Model != asked.Model {
			return fmt.Errorf("%w: %s runs agent %q with model %q; the session asks for %q with model %q",
				ErrAgentMismatch, directory, running.Profile, running.Model, asked.Profile, asked.Model)
		}
	}
	return nil
}

// routesOf copies a sandbox's routes: memory when owned, else Redis.
func (d *Driver) routesOf(ctx context.Context, sandboxID string) ([]store.Route, error) {
	d.mu.Lock()
	sb := d.sandboxes[sandboxID]
	d.mu.Unlock()
	var out []store.Route
	if sb != nil {
		sb.mu.Lock()
		for _, r := range sb.routes {
			out = append(out, *r)
		}
		sb.mu.Unlock()
		return out, nil
	}
	snap, err := store.Load(ctx, d.cfg.Redis, sandboxID)
	if err != nil {
		return nil, err
	}
	for _, r := range snap.Routes {
		out = append(out, *r)
	}
	return out, nil
}
