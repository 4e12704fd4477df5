package gitrepo

import "time"

// FileChangeKind is how a worktree file changed.
type FileChangeKind string

// File change kinds ("" is unspecified).
const (
	FileAdded    FileChangeKind = "added"
	FileModified FileChangeKind = "modified"
	FileDeleted  FileChangeKind = "deleted"
)

// FileChange is one changed file of a worktree.
type FileChange struct {
	Path string
	Kind FileChangeKind
}

// Changes is a worktree's change set against the commit it was checked
// out at: the sandbox service reports it and the session service serves
// it, so both read it as this one type.
type Changes struct {
	Files         []FileChange
	Diff          string
	DiffTruncated bool
	HeadCommit    string
	Time          time.Time
}
