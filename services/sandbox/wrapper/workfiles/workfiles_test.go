package workfiles

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"agentplane.dev/pkg/ident"
	"github.com/stretchr/testify/require"
)

// tree builds a worktree beside a secret outside it:
//
//	base/secret.txt
//	base/wt/{a.txt, dir/b.txt, in -> a.txt, indir -> dir, out -> ../secret.txt,
//	         abs -> /etc/hostname, outdir -> .., fifo}
func tree(t *testing.T) (root string) {
	t.Helper()
	base := t.TempDir()
	root = filepath.Join(base, "wt")
	require.NoError(t, os.MkdirAll(filepath.Join(root, "dir"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(base, "secret.txt"), []byte("secret"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(root, "a.txt"), []byte("hello world"), 0o640))
	require.NoError(t, os.WriteFile(filepath.Join(root, "dir", "b.txt"), []byte("b"), 0o644))
	for link, target := range map[string]string{
		"in": "a.txt", "indir": "dir", "out": "../secret.txt", "abs": "/etc/hostname", "outdir": "..",
	} {
		require.NoError(t, os.Symlink(target, filepath.Join(root, link)))
	}
	require.NoError(t, syscall.Mkfifo(filepath.Join(root, "fifo"), 0o600))
	return root
}

func reason(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ""
}

func TestListDescribesEntriesWithoutFollowing(t *testing.T) {
	root := tree(t)
	es, more, err := List(root, "", "", 0)
	require.NoError(t, err)
	require.False(t, more)
	var names []string
	for _, e := range es {
		names = append(names, e.Name)
	}
	require.Equal(t, []string{"a.txt", "abs", "dir", "fifo", "in", "indir", "out", "outdir"}, names)
	require.Equal(t, Entry{Name: "a.txt", Type: File, Size: 11, Mode: 0o640}, es[0])
	require.Equal(t, Directory, es[2].Type)
	require.Equal(t, Other, es[3].Type)
	require.Equal(t, Symlink, es[6].Type)
}

func TestListPages(t *testing.T) {
	root := tree(t)
	es, more, err := List(root, ".", "", 3)
	require.NoError(t, err)
	require.True(t, more)
	require.Equal(t, "dir", es[2].Name)
	es, more, err = List(root, ".", "dir", 3)
	require.NoError(t, err)
	require.True(t, more)
	require.Equal(t, []string{"fifo", "in", "indir"}, []string{es[0].Name, es[1].Name, es[2].Name})
	es, more, err = List(root, ".", "indir", 3)
	require.NoError(t, err)
	require.False(t, more)
	require.Len(t, es, 2)
}

func TestReadRanges(t *testing.T) {
	root := tree(t)
	data, size, err := Read(root, "a.txt", 6, 0)
	require.NoError(t, err)
	require.Equal(t, "world", string(data))
	require.EqualValues(t, 11, size)
	data, _, err = Read(root, "a.txt", 0, 5)
	require.NoError(t, err)
	require.Equal(t, "hello", string(data))
	data, size, err = Read(root, "a.txt", 100, 5)
	require.NoError(t, err)
	require.Empty(t, data)
	require.EqualValues(t, 11, size)
}

func TestReadIsBounded(t *testing.T) {
	root := tree(t)
	require.NoError(t, os.WriteFile(filepath.Join(root, "big"), make([]byte, ident.MaxWorktreeRead+10), 0o644))
	data, size, err := Read(root, "big", 0, ident.MaxWorktreeRead+10)
	require.NoError(t, err)
	require.Len(t, data, ident.MaxWorktreeRead)
	require.EqualValues(t, ident.MaxWorktreeRead+10, size)
}

// Symlinks that resolve inside the worktree are followed; any that lead out
// of it (relative or absolute) are refused, as are ".." and absolute paths.
func TestConfinement(t *testing.T) {
	root := tree(t)
	data, _, err := Read(root, "in", 0, 0)
	require.NoError(t, err)
	require.Equal(t, "hello world", string(data))
	data, _, err = Read(root, "indir/b.txt", 0, 0)
	require.NoError(t, err)
	require.Equal(t, "b", string(data))
	_, _, err = List(root, "indir", "", 0)
	require.NoError(t, err)

	for _, p := range []string{"out", "abs", "outdir/secret.txt", "../secret.txt", "dir/../../secret.txt", "/etc/hostname"} {
		data, _, err := Read(root, p, 0, 0)
		require.Equal(t, PathEscapes, reason(err), p)
		require.Nil(t, data, p)
	}
	for _, p := range []string{"outdir", "..", "/"} {
		_, _, err := List(root, p, "", 0)
		require.Equal(t, PathEscapes, reason(err), p)
	}
}

func TestRefusalsAreNamed(t *testing.T) {
	root := tree(t)
	_, _, err := Read(root, "missing", 0, 0)
	require.Equal(t, NotFound, reason(err))
	_, _, err = Read(root, "dir", 0, 0)
	require.Equal(t, NotRegularFile, reason(err))
	_, _, err = Read(root, "fifo", 0, 0) // would block without O_NONBLOCK
	require.Equal(t, NotRegularFile, reason(err))
	_, _, err = List(root, "a.txt", "", 0)
	require.Equal(t, NotDirectory, reason(err))
	_, _, err = Read(root, strings.Repeat("a/", 4096), 0, 0)
	require.Equal(t, PathEscapes, reason(err))
}

func TestWriteCreatesAndReplaces(t *testing.T) {
	root := tree(t)
	require.NoError(t, Write(root, "new/deep/c.txt", []byte("c"), 0))
	b, err := os.ReadFile(filepath.Join(root, "new", "deep", "c.txt"))
	require.NoError(t, err)
	require.Equal(t, "c", string(b))
	st, err := os.Stat(filepath.Join(root, "new", "deep", "c.txt"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o644), st.Mode().Perm())

	require.NoError(t, Write(root, "a.txt", []byte("short"), 0))
	b, _ = os.ReadFile(filepath.Join(root, "a.txt"))
	require.Equal(t, "short", string(b), "the old content is gone")
	st, _ = os.Stat(filepath.Join(root, "a.txt"))
	require.Equal(t, os.FileMode(0o640), st.Mode().Perm(), "mode 0 keeps the file's bits")
	require.NoError(t, Write(root, "run.sh", []byte("#!/bin/sh\n"), 0o755))
	st, _ = os.Stat(filepath.Join(root, "run.sh"))
	require.Equal(t, os.FileMode(0o755), st.Mode().Perm())

	require.NoError(t, Write(root, "indir/via-link.txt", []byte("x"), 0), "a symlinked directory inside is written through")
	_, err = os.Stat(filepath.Join(root, "dir", "via-link.txt"))
	require.NoError(t, err)
}

// A write never lands outside the worktree: not through a symlink to a
// file, not through a symlinked directory, not by creating the parents.
func TestWriteConfinement(t *testing.T) {
	root := tree(t)
	base := filepath.Dir(root)
	for _, p := range []string{"out", "abs", "outdir/secret.txt", "outdir/new.txt", "outdir/newdir/x", "../secret.txt", "/tmp/x"} {
		err := Write(root, p, []byte("pwned"), 0)
		require.Equal(t, PathEscapes, reason(err), p)
	}
	b, err := os.ReadFile(filepath.Join(base, "secret.txt"))
	require.NoError(t, err)
	require.Equal(t, "secret", string(b))
	_, err = os.Stat(filepath.Join(base, "new.txt"))
	require.True(t, os.IsNotExist(err))
	_, err = os.Stat(filepath.Join(base, "newdir"))
	require.True(t, os.IsNotExist(err))

	require.Equal(t, NotRegularFile, reason(Write(root, "dir", []byte("x"), 0)))
	require.Equal(t, NotRegularFile, reason(Write(root, "fifo", []byte("x"), 0)), "no reader: refused, not waited on")
	require.Equal(t, NotDirectory, reason(Write(root, "a.txt/x", []byte("x"), 0)))
}
