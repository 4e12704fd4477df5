// Package scope holds the pure rules of a worktree scope's credential state:
// which handle a joining member gets, rotation with a bounded overlap, the
// accepted-handle cap, revocation and resolution. It does no I/O; the caller
// reads the state, applies one operation with the current time, and writes
// the result back under the sandbox owner's fencing token.
package scope

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"slices"
	"time"

	"agentplane.dev/services/credential/internal/handle"
)

// Errors of the scope rules; the gRPC layer maps each to a reason.
var (
	ErrClassMixed        = errors.New("credential class differs from the scope's")
	ErrHandleConflict    = errors.New("scope holds a handle this fence never accepted")
	ErrNoHandle          = errors.New("scope holds no current worktree handle")
	ErrContractDowngrade = errors.New("scope is pinned to the worktree contract")
	ErrNotWorktree       = errors.New("scope does not use the worktree contract")
	ErrUnknownHandle     = errors.New("handle unknown, expired or retired")
	ErrSandboxMismatch   = errors.New("handle belongs to another sandbox")
	ErrNoLiveMember      = errors.New("no live member to resolve the handle through")
	// ErrTenantMismatch: the joining member's tenant (org, user) is not the
	// tenant of the scope's members; one scope's handle never serves two.
	ErrTenantMismatch = errors.New("scope belongs to another tenant")
)

// MaxAccepted is the most live worktree entries a scope holds.
const MaxAccepted = 4

// Scope is one directory of one sandbox.
type Scope struct {
	SandboxID string `json:"sandbox"`
	Directory string `json:"directory"`
}

// ID is a stable, key-safe name of the scope (the directory may contain any
// character, including braces that would break a Redis hash tag).
func (s Scope) ID() string {
	sum := sha256.Sum256([]byte(s.SandboxID + "\x00" + s.Directory))
	return hex.EncodeToString(sum[:16])
}

// Class is a backing credential class; one per directory.
type Class string

// Contract is the runtime contract of the scope.
type Contract string

// Classes and contracts.
const (
	Delegated  Class    = "delegated"
	Static     Class    = "static"
	PerSession Contract = "per_session"
	Worktree   Contract = "worktree"
)

// Member is a session using the scope.
type Member struct {
	SessionID        string `json:"session"`
	RuntimeSessionID string `json:"runtime_session"`
	UserID           string `json:"user"`
	OrgID            string `json:"org,omitempty"`
	CredentialRef    string `json:"credential_ref"`
	// GitCredentialRef names the member's git credential (the repository it
	// admits and its token) for the proxy's git route; empty: none.
	GitCredentialRef string `json:"git_credential_ref,omitempty"`
}

// Entry is one accepted handle, by digest only.
type Entry struct {
	Digest        string      `json:"digest"`
	Kind          handle.Kind `json:"kind"`
	Issuer        string      `json:"issuer"`          // session that minted it
	Owner         string      `json:"owner,omitempty"` // per-session handles: their session
	AcceptedFence uint64      `json:"fence"`
	IssuedAt      time.Time   `json:"issued"`
	ExpireAt      time.Time   `json:"expire"`
	RetireAt      time.Time   `json:"retire,omitzero"` // set when replaced: end of the overlap
	Sealed        []byte      `json:"sealed"`          // the raw handle, encrypted, for re-delivery
}

// Current reports whether e is not replaced.
func (e Entry) Current() bool { return e.RetireAt.IsZero() }

// Live reports whether e still resolves at now.
func (e Entry) Live(now time.Time) bool { return now.Before(e.end()) }

// end is when e stops resolving: its expiry, or the end of its overlap.
func (e Entry) end() time.Time {
	if !e.RetireAt.IsZero() && e.RetireAt.Before(e.ExpireAt) {
		return e.RetireAt
	}
	return e.ExpireAt
}

// State is everything stored about a scope.
type State struct {
	Scope        Scope    `json:"scope"`
	AllocationID string   `json:"allocation,omitempty"`
	Class        Class    `json:"class,omitempty"`
	Contract     Contract `json:"contract,omitempty"`
	Members      []Member `json:"members,omitempty"` // in join order
	Entries      []Entry  `json:"entries,omitempty"` // oldest first
}

// Empty reports whether nothing is left to store.
func (s *State) Empty() bool { return len(s.Members) == 0 && len(s.Entries) == 0 }

// Policy holds the configurable numbers.
type Policy struct {
	GrantTTL      time.Duration // a grant's lifetime (4 h)
	ReissueBelow  time.Duration // re-issue on delivery when less remains (1 h)
	OverlapWindow time.Duration // how long a replaced handle still resolves
}

// Candidate is a freshly generated handle the caller offers; the rules
// decide whether it is used.
type Candidate struct {
	Digest string
	Sealed []byte
}

// Join is a member joining with its backing credential.
type Join struct {
	Member       Member
	Class        Class
	Contract     Contract // Mint only
	Fence        uint64
	AllocationID string // Mint only; a change retires every entry first
}

// Result is the entry a member got.
type Result struct {
	Entry   Entry
	Adopted bool // an already accepted handle was returned
	Minted  bool // the candidate was used
}

func (s *State) prune(now time.Time) {
	s.Entries = slices.DeleteFunc(s.Entries, func(e Entry) bool { return !e.Live(now) })
}

func (s *State) checkClass(c Class) error {
	if s.Class != "" && s.Class != c && !s.Empty() {
		return ErrClassMixed
	}
	return nil
}

// checkTenant refuses a member whose tenant differs from any live member's
// (the sandbox service binds a sandbox to one tenant; this holds the
// credential side to it too).
func (s *State) checkTenant(m Member) error {
	for _, o := range s.Members {
		if o.SessionID != m.SessionID && (o.OrgID != m.OrgID || o.UserID != m.UserID) {
			return ErrTenantMismatch
		}
	}
	return nil
}

func (s *State) upsertMember(m Member) {
	for i := range s.Members {
		if s.Members[i].SessionID == m.SessionID {
			s.Members[i] = m
			return
		}
	}
	s.Members = append(s.Members, m)
}

// MemberBySession returns the live member with that session id.
func (s *State) MemberBySession(id string) (Member, bool) {
	for _, m := range s.Members {
		if m.SessionID == id {
			return m, true
		}
	}
	return Member{}, false
}

// MemberByRoot returns the live member whose runtime session id is rsid.
func (s *State) MemberByRoot(rsid string) (Member, bool) {
	for _, m := range s.Members {
		if rsid != "" && m.RuntimeSessionID == rsid {
			return m, true
		}
	}
	return Member{}, false
}

func (s *State) currentWorktree() int {
	for i, e := range s.Entries {
		if e.Kind == handle.Worktree && e.Current() {
			return i
		}
	}
	return -1
}

func (s *State) currentPerSession(session string) int {
	for i, e := range s.Entries {
		if e.Kind == handle.PerSession && e.Owner == session && e.Current() {
			return i
		}
	}
	return -1
}

// reissue extends a grant delivered with less than ReissueBelow left.
func (s *State) reissue(i int, now time.Time, p Policy) {
	if s.Entries[i].ExpireAt.Sub(now) < p.ReissueBelow {
		s.Entries[i].ExpireAt = now.Add(p.GrantTTL)
	}
}

// enforceCap evicts the oldest non-current worktree entries beyond MaxAccepted.
func (s *State) enforceCap() {
	for {
		n, oldest := 0, -1
		for i, e := range s.Entries {
			if e.Kind != handle.Worktree {
				continue
			}
			n++
			if !e.Current() && oldest < 0 {
				oldest = i
			}
		}
		if n <= MaxAccepted || oldest < 0 {
			return
		}
		s.Entries = slices.Delete(s.Entries, oldest, oldest+1)
	}
}

func (s *State) retireEntries() int {
	n := len(s.Entries)
	s.Entries = nil
	return n
}

// Mint gives the joining member the scope's handle: under the worktree
// contract the current canonical handle if this fence accepted it, else the
// candidate when the scope holds none; under per_session its own handle.
// Calling it again with the same fence returns the same handle.
func (s *State) Mint(j Join, cand Candidate, now time.Time, p Policy) (Result, error) {
	s.prune(now)
	if err := s.checkTenant(j.Member); err != nil {
		return Result{}, err
	}
	if err := s.checkClass(j.Class); err != nil {
		return Result{}, err
	}
	if s.Contract == Worktree && j.Contract == PerSession {
		return Result{}, ErrContractDowngrade
	}
	if j.AllocationID != "" && s.AllocationID != "" && j.AllocationID != s.AllocationID {
		s.retireEntries() // allocation change: nothing accepted before survives
	}
	kind, idx := handle.Worktree, s.currentWorktree()
	if j.Contract == PerSession {
		kind, idx = handle.PerSession, s.currentPerSession(j.Member.SessionID)
	}
	var res Result
	switch {
	case idx >= 0 && s.Entries[idx].AcceptedFence == j.Fence:
		s.reissue(idx, now, p)
		res = Result{Entry: s.Entries[idx], Adopted: true}
	case idx >= 0 && kind == handle.Worktree:
		return Result{}, ErrHandleConflict
	default:
		if idx >= 0 { // a per-session handle of an older fence: replace it now
			s.Entries = slices.Delete(s.Entries, idx, idx+1)
		}
		e := Entry{
			Digest: cand.Digest, Kind: kind, Issuer: j.Member.SessionID,
			AcceptedFence: j.Fence, IssuedAt: now, ExpireAt: now.Add(p.GrantTTL), Sealed: cand.Sealed,
		}
		if kind == handle.PerSession {
			e.Owner = j.Member.SessionID
		}
		s.Entries = append(s.Entries, e)
		s.enforceCap()
		res = Result{Entry: e, Minted: true}
	}
	if s.Contract != Worktree {
		s.Contract = j.Contract
	}
	s.Class = j.Class
	if j.AllocationID != "" {
		s.AllocationID = j.AllocationID
	}
	s.upsertMember(j.Member)
	return res, nil
}

// Adopt gives a compatible sibling the accepted canonical handle.
func (s *State) Adopt(j Join, now time.Time, p Policy) (Result, error) {
	s.prune(now)
	if err := s.checkTenant(j.Member); err != nil {
		return Result{}, err
	}
	if err := s.checkClass(j.Class); err != nil {
		return Result{}, err
	}
	idx := s.currentWorktree()
	if idx < 0 {
		return Result{}, ErrNoHandle
	}
	if s.Entries[idx].AcceptedFence != j.Fence {
		return Result{}, ErrHandleConflict
	}
	s.reissue(idx, now, p)
	s.Class = j.Class
	s.upsertMember(j.Member)
	return Result{Entry: s.Entries[idx], Adopted: true}, nil
}

// Rotate replaces the canonical handle for every member at once; the old one
// resolves until the returned time.
func (s *State) Rotate(fence uint64, cand Candidate, now time.Time, p Policy) (Entry, time.Time, error) {
	s.prune(now)
	if s.Contract != Worktree {
		return Entry{}, time.Time{}, ErrNotWorktree
	}
	idx := s.currentWorktree()
	if idx < 0 {
		return Entry{}, time.Time{}, ErrNoHandle
	}
	until := now.Add(p.OverlapWindow)
	old := s.Entries[idx]
	if old.ExpireAt.Before(until) {
		until = old.ExpireAt
	}
	s.Entries[idx].RetireAt = until
	e := Entry{
		Digest: cand.Digest, Kind: handle.Worktree, Issuer: old.Issuer,
		AcceptedFence: fence, IssuedAt: now, ExpireAt: now.Add(p.GrantTTL), Sealed: cand.Sealed,
	}
	s.Entries = append(s.Entries, e)
	s.enforceCap()
	return e, until, nil
}

// Release removes a member and its per-session handles; the last member
// retires the scope. It returns whether the scope was retired.
func (s *State) Release(session string) (retired bool, remaining int) {
	s.Members = slices.DeleteFunc(s.Members, func(m Member) bool { return m.SessionID == session })
	s.Entries = slices.DeleteFunc(s.Entries, func(e Entry) bool { return e.Owner == session })
	if len(s.Members) == 0 {
		s.retireEntries()
		return true, 0
	}
	return false, len(s.Members)
}

// Retire drops every accepted entry (wrapper restart, allocation change);
// when lastMember, the members go too.
func (s *State) Retire(lastMember bool) int {
	n := s.retireEntries()
	if lastMember {
		s.Members = nil
	}
	return n
}

// Resolution is a handle resolved through a live member.
type Resolution struct {
	Entry  Entry
	Member Member
}

// Resolve finds the live entry with digest and the member it resolves
// through: the issuer (or owner) while it is a member, else the earliest
// joined live member for a worktree handle.
func (s *State) Resolve(digest handle.Digest, sandboxID string, now time.Time) (Resolution, error) {
	var found *Entry
	for i := range s.Entries {
		d, err := handle.ParseDigest(s.Entries[i].Digest)
		if err == nil && d.Equal(digest) && found == nil {
			found = &s.Entries[i]
		}
	}
	if found == nil || !found.Live(now) {
		return Resolution{}, ErrUnknownHandle
	}
	if s.Scope.SandboxID != sandboxID {
		return Resolution{}, ErrSandboxMismatch
	}
	if found.Kind == handle.PerSession {
		m, ok := s.MemberBySession(found.Owner)
		if !ok {
			return Resolution{}, ErrNoLiveMember
		}
		return Resolution{Entry: *found, Member: m}, nil
	}
	if m, ok := s.MemberBySession(found.Issuer); ok {
		return Resolution{Entry: *found, Member: m}, nil
	}
	if len(s.Members) == 0 {
		return Resolution{}, ErrNoLiveMember
	}
	return Resolution{Entry: *found, Member: s.Members[0]}, nil
}

// LiveWorktreeEntries counts live worktree entries (the capped store).
func (s *State) LiveWorktreeEntries(now time.Time) int {
	n := 0
	for _, e := range s.Entries {
		if e.Kind == handle.Worktree && e.Live(now) {
			n++
		}
	}
	return n
}

// NextExpiry is when the state's last entry stops resolving (for key TTLs).
func (s *State) NextExpiry() time.Time {
	var t time.Time
	for _, e := range s.Entries {
		if e.ExpireAt.After(t) {
			t = e.ExpireAt
		}
	}
	return t
}

// Clone returns a copy that shares no slice with s.
func (s *State) Clone() *State {
	c := *s
	c.Members = slices.Clone(s.Members)
	c.Entries = slices.Clone(s.Entries)
	return &c
}

// Narrows reports whether after resolves less than before: a member removed,
// changed or moved, or an entry removed, changed or ending sooner. Members
// appended, entries added and expiries extended only widen what resolves.
func Narrows(before, after *State) bool {
	if len(after.Members) < len(before.Members) {
		return true
	}
	for i, m := range before.Members {
		if after.Members[i] != m {
			return true // Resolve falls back to Members[0]: the order matters too
		}
	}
	for _, old := range before.Entries {
		i := slices.IndexFunc(after.Entries, func(e Entry) bool { return e.Digest == old.Digest })
		if i < 0 {
			return true
		}
		e := after.Entries[i]
		if e.Kind != old.Kind || e.Issuer != old.Issuer || e.Owner != old.Owner || e.end().Before(old.end()) {
			return true
		}
	}
	return false
}
