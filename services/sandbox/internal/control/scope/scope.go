// Package scope holds worktree scopes: the members of one (sandbox,
// directory) and the runtime contract negotiated for the directory.
//
// Contract rules (DESIGN.md 5): a wrapper without the worktree capability, or
// with a stale protocol version, means per_session; the directory's first
// authenticated wrapper pins the contract; a later wrapper that would
// downgrade a pinned worktree contract is rejected with
// ErrContractDowngrade. A per_session pin stays per_session even when a newer
// wrapper arrives (its sessions keep their per-session handles and runtimes).
package scope

import (
	"errors"
	"slices"
)

// Contract is a runtime contract.
type Contract string

const (
	Unpinned   Contract = ""
	PerSession Contract = "per_session"
	Worktree   Contract = "worktree"
)

// CapabilityWorktree is the wrapper capability for one runtime per directory.
const CapabilityWorktree = "worktree"

// MinWorktreeProtocol is the oldest wrapper protocol whose worktree
// capability counts; an older one is stale.
const MinWorktreeProtocol = 1

// Errors.
var (
	ErrContractDowngrade = errors.New("scope: runtime contract downgrade: the directory is pinned to worktree and the wrapper lacks a current worktree capability")
	ErrClassMixed        = errors.New("scope: a directory holds one credential class")
)

// Offered is the contract a wrapper can serve.
func Offered(capabilities []string, protocolVersion uint32) Contract {
	if slices.Contains(capabilities, CapabilityWorktree) && protocolVersion >= MinWorktreeProtocol {
		return Worktree
	}
	return PerSession
}

// Negotiate returns the directory's contract once a wrapper offering offered
// authenticated, and whether it pins the contract now.
func Negotiate(pinned, offered Contract) (Contract, bool, error) {
	switch pinned {
	case Unpinned:
		return offered, true, nil
	case Worktree:
		if offered != Worktree {
			return Worktree, false, ErrContractDowngrade
		}
	}
	return pinned, false, nil
}

// RuntimeKey is the directory under worktree and the session id otherwise.
// An unpinned directory is keyed by its directory: its first wrapper
// negotiates the contract.
func RuntimeKey(c Contract, directory, sessionID string) string {
	if c == PerSession {
		return sessionID
	}
	return directory
}

// Scope is one (sandbox, directory).
type Scope struct {
	SandboxID string            `json:"sandbox_id"`
	Directory string            `json:"directory"`
	Contract  Contract          `json:"contract,omitempty"`
	Class     string            `json:"class,omitempty"`
	Members   map[string]string `json:"members,omitempty"` // session id → runtime session id
}

// Admit checks that a session of credential class may join.
func (s *Scope) Admit(sessionID, class string) error {
	others := len(s.Members)
	if _, ok := s.Members[sessionID]; ok {
		others--
	}
	if others > 0 && s.Class != "" && class != "" && class != s.Class {
		return ErrClassMixed
	}
	return nil
}

// Join adds or updates a member.
func (s *Scope) Join(sessionID, runtimeSessionID, class string) {
	if s.Members == nil {
		s.Members = map[string]string{}
	}
	s.Members[sessionID] = runtimeSessionID
	if s.Class == "" || len(s.Members) == 1 {
		s.Class = class
	}
}

// Leave removes a member and reports whether it was the last one.
func (s *Scope) Leave(sessionID string) (last bool) {
	delete(s.Members, sessionID)
	return len(s.Members) == 0
}

// SortedMembers returns the member ids in order.
func (s *Scope) SortedMembers() []string {
	ids := make([]string, 0, len(s.Members))
	for id := range s.Members {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}
