package worktree

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// emptyTree is git's empty tree: the base of a repository without commits.
const emptyTree = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"

// ChangeKind is how a file changed.
type ChangeKind string

// Kinds.
const (
	Added    ChangeKind = "added"
	Modified ChangeKind = "modified"
	Deleted  ChangeKind = "deleted"
)

// FileChange is one changed file.
type FileChange struct {
	Path string     `json:"path"`
	Kind ChangeKind `json:"kind"`
}

// Changes is a worktree's change set against HEAD.
type Changes struct {
	Files     []FileChange `json:"files"`
	Diff      string       `json:"diff"`
	Truncated bool         `json:"diff_truncated"`
	Head      string       `json:"head_commit"`
	Time      time.Time    `json:"time"`
}

// ErrNotARepository: the workspace is no git checkout.
var ErrNotARepository = errors.New("worktree: the workspace is not a git checkout")

// IsRepository reports whether dir is a checkout (of ours or not).
func IsRepository(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, ".git"))
	return err == nil
}

// Report returns dir's change set: every file changed, added (untracked
// included, ignored files not) or deleted against HEAD, and the unified
// diff cut at maxDiff bytes. It stages into a private index, so neither
// the worktree's index nor its files change.
func Report(ctx context.Context, dir string, maxDiff int) (*Changes, error) {
	if !IsRepository(dir) {
		return nil, ErrNotARepository
	}
	tmp, err := os.CreateTemp(filepath.Join(dir, ".git"), "agentplane-index-")
	if err != nil {
		return nil, err
	}
	index := tmp.Name()
	_ = tmp.Close()
	defer func() { _ = os.Remove(index) }()
	if b, err := os.ReadFile(filepath.Join(dir, ".git", "index")); err == nil {
		if err := os.WriteFile(index, b, 0o600); err != nil {
			return nil, err
		}
	} else {
		_ = os.Remove(index) // git creates it
	}
	run := func(args ...string) (string, error) {
		cmd := gitCmd(ctx, dir, gitEnv("GIT_INDEX_FILE="+index), args...)
		out, err := cmd.Output()
		return string(out), err
	}
	head, err := run("rev-parse", "--verify", "--quiet", "HEAD")
	base := trim(head)
	if err != nil || base == "" {
		base = emptyTree
		head = ""
	}
	if _, err := run("add", "-A", "--", "."); err != nil {
		return nil, err
	}
	names, err := run("diff", "--cached", "--no-renames", "--name-status", "-z", base)
	if err != nil {
		return nil, err
	}
	out := &Changes{Head: trim(head), Time: time.Now().UTC(), Files: parseNameStatus(names)}
	diff, err := run("diff", "--cached", "--no-renames", "--no-color", "--no-ext-diff", base)
	if err != nil {
		return nil, err
	}
	if maxDiff > 0 && len(diff) > maxDiff {
		diff, out.Truncated = diff[:maxDiff], true
	}
	out.Diff = diff
	return out, nil
}

// parseNameStatus reads `git diff --name-status -z` output: status NUL path NUL ...
func parseNameStatus(s string) []FileChange {
	parts := strings.Split(s, "\x00")
	var files []FileChange
	for i := 0; i+1 < len(parts); i += 2 {
		st, path := parts[i], parts[i+1]
		if st == "" || path == "" {
			continue
		}
		k := Modified
		switch st[0] {
		case 'A':
			k = Added
		case 'D':
			k = Deleted
		}
		files = append(files, FileChange{Path: path, Kind: k})
	}
	sort.Slice(files, func(a, b int) bool { return files[a].Path < files[b].Path })
	return files
}
