// Package ident is the syntax of the ids and worktree directories every
// agentplane API accepts, public and internal alike: an internal caller
// (or anyone holding the internal token) must not get a value past a
// service that the public API would refuse ("s/..", "..", "../x").
package ident

import (
	"fmt"
	"path"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Limits.
const (
	MaxIDLen        = 64
	MaxDirectoryLen = 4096
)

// ID returns what is wrong with an id (session, sandbox, runtime session,
// user, org, message, credential reference), or "": 1 to 64 of
// [a-zA-Z0-9_-]. No '.', '/', ':' or braces, so an id is never a path
// segment like "..", never splits a key and never breaks a Redis hash tag.
func ID(v string) string {
	if v == "" {
		return "required"
	}
	if len(v) > MaxIDLen {
		return fmt.Sprintf("at most %d characters", MaxIDLen)
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return "only letters, digits, '_' and '-' are allowed"
		}
	}
	return ""
}

// OptionalID is ID for an id that may be empty.
func OptionalID(v string) string {
	if v == "" {
		return ""
	}
	return ID(v)
}

// Directory returns what is wrong with a worktree directory, or "":
// absolute, already normalized (no "..", ".", "//" or trailing slash), not
// the root, printable UTF-8 without backslashes.
func Directory(v string) string {
	switch {
	case v == "":
		return "required"
	case len(v) > MaxDirectoryLen:
		return fmt.Sprintf("at most %d bytes", MaxDirectoryLen)
	case !utf8.ValidString(v):
		return "must be valid UTF-8"
	case strings.ContainsFunc(v, func(r rune) bool { return unicode.IsControl(r) || r == '\\' }):
		return "must not contain control characters or backslashes"
	case !strings.HasPrefix(v, "/"):
		return "must be an absolute path"
	case path.Clean(v) != v:
		return "must be normalized (no '..', '.', '//' or trailing '/')"
	case v == "/":
		return "must not be the root directory"
	}
	return ""
}

// SandboxSystemDirs are the paths every agent sandbox mounts for itself
// (docs/sandbox.md, "Inside"): the system directories, /etc, /proc, /dev,
// /run (the host's sockets), and /sys, the host's kernel interface. A
// worktree directory at or below one of them cannot be where the sandbox
// binds the session's workspace: it would hide the system the agent runs
// on, or be made inside a read-only host directory.
var SandboxSystemDirs = []string{"/bin", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin", "/sys", "/usr"}

// SandboxOwnDir holds what the sandbox places at paths of its own: the
// runtime's HOME (/agentplane/home), the start-up probe's workspace.
const SandboxOwnDir = "/agentplane"

// SandboxTmp is the sandbox's private temporary directory: a directory
// below it is bound on top of it, but the directory itself would replace it.
const SandboxTmp = "/tmp"

// ReservedDirectory returns what is wrong with an otherwise valid worktree
// directory as the place the session's workspace appears inside its
// sandbox (DESIGN.md 3.6), or "": not at or below one of
// SandboxSystemDirs or SandboxOwnDir, not /tmp itself. The sandbox service
// refuses, at launch, the few paths only it knows besides (the wrapper
// binary, bubblewrap, the installed agents).
func ReservedDirectory(v string) string {
	if v == SandboxTmp {
		return "/tmp is the sandbox's own temporary directory; use a directory below it or elsewhere"
	}
	for _, d := range SandboxSystemDirs {
		if v == d || strings.HasPrefix(v, d+"/") {
			return d + " is a system path every sandbox mounts itself; choose a directory outside it"
		}
	}
	if v == SandboxOwnDir || strings.HasPrefix(v, SandboxOwnDir+"/") {
		return SandboxOwnDir + " holds the sandbox's own HOME and agents; choose a directory outside it"
	}
	return ""
}

// MaxAuthorLen bounds a commit author's name and email.
const MaxAuthorLen = 256

// AuthorName returns what is wrong with an optional commit author name, or
// "": git would drop angle brackets, and a line break would write another
// header into the commit.
func AuthorName(v string) string {
	if len(v) > MaxAuthorLen || strings.ContainsAny(v, "<>") || strings.ContainsFunc(v, unicode.IsControl) {
		return fmt.Sprintf("at most %d bytes, no angle bracket, line break or control character", MaxAuthorLen)
	}
	return ""
}

// AuthorEmail returns what is wrong with an optional commit author email,
// or "": the name's rules, exactly one "@" and no space.
func AuthorEmail(v string) string {
	if v != "" && (AuthorName(v) != "" || strings.Count(v, "@") != 1 || strings.ContainsFunc(v, unicode.IsSpace)) {
		return fmt.Sprintf(`an email address: at most %d bytes, one "@", no angle bracket, space or control character`, MaxAuthorLen)
	}
	return ""
}

// MaxWorktreePath bounds a path inside a worktree.
const MaxWorktreePath = 4096

// Bounds of the worktree file calls, one set for the session service, the
// sandbox service and the wrapper that serves them.
const (
	MaxWorktreeEntries    = 1000    // entries of one listing page
	MaxWorktreeRead       = 1 << 20 // bytes of one read
	MaxWorktreeWriteFiles = 100     // files of one write batch
	MaxWorktreeWriteBytes = 3 << 20 // data of one write batch: under gRPC's 4 MiB message bound, with room
)

// WorktreePath returns what is wrong with a path relative to a worktree, or
// "": never absolute, no ".." component. The wrapper's kernel-side
// confinement holds anyway; this refuses the obvious at the door.
func WorktreePath(p string) string {
	rule := fmt.Sprintf(`relative to the worktree, no ".." component, no NUL, at most %d bytes`, MaxWorktreePath)
	if len(p) > MaxWorktreePath || strings.HasPrefix(p, "/") || strings.ContainsRune(p, 0) {
		return rule
	}
	for _, c := range strings.Split(p, "/") {
		if c == ".." {
			return rule
		}
	}
	return ""
}
