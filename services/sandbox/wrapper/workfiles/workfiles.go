// Package workfiles lists, reads and writes files of a worktree from inside
// the boundary, confined to it: every path is resolved by the kernel beneath the
// worktree's root (openat2 RESOLVE_BENEATH), so neither ".." nor a symlink
// can lead out of it, however the tree changes meanwhile. A symlink that
// stays inside the worktree (relative, resolving beneath the root) is
// followed; an absolute one or one leading out is refused with
// PATH_ESCAPES_WORKTREE (docs/worktrees.md).
package workfiles

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"agentplane.dev/pkg/ident"
)

// Failure reasons (UPPER_SNAKE, as gRPC ErrorInfo; docs/errors.md).
const (
	PathEscapes    = "PATH_ESCAPES_WORKTREE"
	NotFound       = "FILE_NOT_FOUND"
	NotDirectory   = "NOT_A_DIRECTORY"
	NotRegularFile = "NOT_A_REGULAR_FILE"
	Unavailable    = "WORKTREE_UNAVAILABLE"
)

// Error is a refused file action with its reason; Detail names no path
// outside the worktree.
type Error struct{ Reason, Detail string }

func (e *Error) Error() string { return "workfiles: " + e.Reason + ": " + e.Detail }

// Type is what a directory entry is.
type Type int

// Types.
const (
	File Type = iota + 1
	Directory
	Symlink
	Other
)

// Entry is one directory entry; a symlink is not followed.
type Entry struct {
	Name string
	Type Type
	Size int64
	Mode uint32 // permission bits
}

// List returns up to limit entries of the directory rel, sorted by name,
// after the name after, and whether more remain.
func List(root, rel, after string, limit int) ([]Entry, bool, error) {
	if limit <= 0 || limit > ident.MaxWorktreeEntries {
		limit = ident.MaxWorktreeEntries
	}
	f, err := open(root, rel, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, false, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, false, &Error{Reason: Unavailable, Detail: "the directory could not be read"}
	}
	sort.Strings(names)
	i := sort.SearchStrings(names, after)
	if i < len(names) && names[i] == after {
		i++
	}
	out := make([]Entry, 0, min(limit, len(names)-i))
	for ; i < len(names) && len(out) < limit; i++ {
		var st unix.Stat_t
		// Relative to the directory's descriptor, never following: the
		// entry is described, not resolved.
		if err := unix.Fstatat(int(f.Fd()), names[i], &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			continue // gone since it was listed
		}
		out = append(out, Entry{Name: names[i], Type: typeOf(st.Mode), Size: st.Size, Mode: st.Mode & 0o7777})
	}
	return out, i < len(names), nil
}

// Read returns up to n bytes of the regular file rel from offset, and the
// file's size.
func Read(root, rel string, offset int64, n int) ([]byte, int64, error) {
	if n <= 0 || n > ident.MaxWorktreeRead {
		n = ident.MaxWorktreeRead
	}
	// O_NONBLOCK: opening a fifo must not wait for a writer; it is refused
	// below as not a regular file.
	f, err := open(root, rel, unix.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, 0, &Error{Reason: Unavailable, Detail: "the file could not be read"}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, 0, &Error{Reason: NotRegularFile, Detail: rel + " is not a regular file"}
	}
	buf := make([]byte, min(int64(n), max(st.Size-offset, 0)))
	k, err := f.ReadAt(buf, offset)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, 0, &Error{Reason: Unavailable, Detail: "the file could not be read"}
	}
	return buf[:k], st.Size, nil
}

// Write replaces the regular file rel (created, with missing parent
// directories, when absent) with data. mode 0 keeps an existing file's
// permission bits and gives a new one 0o644. A symlink inside the worktree
// is written through, as Read follows it.
func Write(root, rel string, data []byte, mode uint32) error {
	if dir := path.Dir(path.Clean(rel)); dir != "." {
		if err := mkdirAll(root, dir); err != nil {
			return err
		}
	}
	// O_NONBLOCK: a fifo without a reader is refused (ENXIO), not waited on.
	f, err := open(root, rel, unix.O_WRONLY|unix.O_CREAT|unix.O_NONBLOCK, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return &Error{Reason: NotRegularFile, Detail: rel + " is not a regular file"}
	}
	if mode != 0 {
		if err := f.Chmod(os.FileMode(mode & 0o777)); err != nil {
			return &Error{Reason: Unavailable, Detail: rel + " could not be written"}
		}
	}
	// Truncated only now: nothing else is ever truncated by a write refused
	// above.
	if err := f.Truncate(0); err != nil {
		return &Error{Reason: Unavailable, Detail: rel + " could not be written"}
	}
	if _, err := f.Write(data); err != nil {
		return &Error{Reason: Unavailable, Detail: fmt.Sprintf("%s could not be written: %v", rel, err)}
	}
	return nil
}

// mkdirAll makes the directory rel and its missing parents beneath root,
// one component at a time, each made in its parent resolved beneath root.
func mkdirAll(root, rel string) error {
	parent := "."
	for _, c := range strings.Split(rel, "/") {
		p := path.Join(parent, c)
		d, err := open(root, p, unix.O_PATH|unix.O_DIRECTORY, 0)
		if err == nil {
			d.Close()
			parent = p
			continue
		}
		var e *Error
		if !errors.As(err, &e) || e.Reason != NotFound {
			return err
		}
		pd, err := open(root, parent, unix.O_PATH|unix.O_DIRECTORY, 0)
		if err != nil {
			return err
		}
		err = unix.Mkdirat(int(pd.Fd()), c, 0o755)
		pd.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return openError(p, err)
		}
		parent = p
	}
	return nil
}

// open opens rel beneath root. The kernel resolves it: ".." and symlinks
// may move within the worktree but never out of it (EXDEV), and an
// absolute symlink is refused whatever it names.
func open(root, rel string, flags int, mode uint32) (*os.File, error) {
	if why := ident.WorktreePath(rel); why != "" {
		return nil, &Error{Reason: PathEscapes, Detail: "path must be " + why}
	}
	if rel == "" {
		rel = "."
	}
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &Error{Reason: Unavailable, Detail: "the worktree is not there"}
	}
	defer func() { _ = unix.Close(rfd) }()
	fd, err := unix.Openat2(rfd, rel, &unix.OpenHow{
		Flags:   uint64(flags) | unix.O_CLOEXEC,
		Mode:    uint64(mode),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, openError(rel, err)
	}
	return os.NewFile(uintptr(fd), rel), nil
}

func openError(rel string, err error) error {
	switch {
	case errors.Is(err, unix.EXDEV), errors.Is(err, unix.ELOOP):
		return &Error{Reason: PathEscapes, Detail: rel + " resolves outside the worktree (a symlink leads out of it)"}
	case errors.Is(err, unix.ENOENT):
		return &Error{Reason: NotFound, Detail: rel + " does not exist in the worktree"}
	case errors.Is(err, unix.EISDIR), errors.Is(err, unix.ENXIO):
		return &Error{Reason: NotRegularFile, Detail: rel + " is not a regular file"}
	case errors.Is(err, unix.ENOTDIR):
		return &Error{Reason: NotDirectory, Detail: rel + " is not a directory (or a component of it is not)"}
	case errors.Is(err, unix.ENOSYS):
		return &Error{Reason: Unavailable, Detail: "the kernel lacks openat2, which confines paths to the worktree"}
	}
	return &Error{Reason: Unavailable, Detail: fmt.Sprintf("%s could not be opened: %v", rel, err)}
}

func typeOf(mode uint32) Type {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return File
	case unix.S_IFDIR:
		return Directory
	case unix.S_IFLNK:
		return Symlink
	}
	return Other
}
