// Package testenv says what a test does when a part of the machine it
// needs (a tool, a mount, a pinned agent) is missing.
package testenv

import (
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

// Missing ends a test whose component is missing. Under CI=true, where
// .ci/run installs everything, that is a failure; elsewhere the test is
// skipped and says so, never counted as passed.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("missing under CI=true: "+format, args...)
	}
	t.Skipf("SKIPPED, not passed: "+format, args...)
}

// AsUID runs the tests of this test binary named by run (a -test.run
// pattern) in a copy of the binary as uid (and gid uid) without
// capabilities or supplementary groups, and fails t with the copy's output
// if they fail. The copy lives in a directory the uid can reach (go test
// builds into one only root can enter). env is passed through on top of
// PATH, TMPDIR and CI. The caller runs as root.
func AsUID(t testing.TB, uid int, run string, env ...string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "asuid-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	bin := filepath.Join(dir, filepath.Base(os.Args[0]))
	if err := errors.Join(os.Chmod(dir, 0o755), copyFile(os.Args[0], bin)); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run", run, "-test.count=1", "-test.v", "-test.timeout=5m")
	cmd.Dir = dir
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "TMPDIR=/tmp"}, env...)
	if ci := os.Getenv("CI"); ci != "" {
		cmd.Env = append(cmd.Env, "CI="+ci)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), Groups: []uint32{}}}
	out, err := cmd.CombinedOutput()
	t.Logf("as uid %d:\n%s", uid, out)
	if err != nil {
		t.Fatalf("the test failed as uid %d: %v", uid, err)
	}
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	return errors.Join(err, out.Close())
}

// SandboxRoot is a new directory for a sandbox service's root that the
// sandboxes' own user (nobody when the tests run as root) can traverse:
// t.TempDir's directories are 0700.
func SandboxRoot(t testing.TB) string {
	t.Helper()
	root := t.TempDir()
	for _, dir := range []string{filepath.Dir(root), root} {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return root
}
