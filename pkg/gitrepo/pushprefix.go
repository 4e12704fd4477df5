package gitrepo

import "strings"

// DefaultPushBranchPrefix is the branch prefix a session's pushes are
// confined to when it names none.
const DefaultPushBranchPrefix = "agent/"

// MaxPushPrefixBytes bounds a push branch prefix.
const MaxPushPrefixBytes = 100

// PushPrefixRule describes ValidPushPrefix for field violations, so the
// session service (CreateSession) and the credential service
// (PutBackingCredential) tell a caller the same thing.
const PushPrefixRule = "empty (agent/) or a valid git branch path of at most 100 bytes ending in /"

// ValidPushPrefix reports whether s may be a session's push branch prefix:
// "" (the default) or a git-valid ref path of at most MaxPushPrefixBytes
// ending in "/". One rule for the session service, which refuses a bad
// prefix at CreateSession, and the credential service, whose git route
// enforces it.
func ValidPushPrefix(s string) bool {
	if s == "" {
		return true
	}
	return len(s) <= MaxPushPrefixBytes && strings.HasSuffix(s, "/") && SafeRefName("refs/heads/"+s+"x")
}

// SafeRefName is a conservative form of git's check-ref-format: no
// component that is empty or starts with ".", no "..", "@{", ".lock"
// component ending, control character, space or ~^:?*[\ . The upstream
// checks too; this keeps a name git would read differently from passing
// a prefix check.
func SafeRefName(ref string) bool {
	if strings.Contains(ref, "..") || strings.Contains(ref, "@{") || ref == "@" {
		return false
	}
	for i := 0; i < len(ref); i++ {
		if c := ref[i]; c <= ' ' || c == 0x7f || strings.IndexByte("~^:?*[\\", c) >= 0 {
			return false
		}
	}
	for comp := range strings.SplitSeq(ref, "/") {
		if comp == "" || comp[0] == '.' || strings.HasSuffix(comp, ".lock") || strings.HasSuffix(comp, ".") {
			return false
		}
	}
	return true
}
