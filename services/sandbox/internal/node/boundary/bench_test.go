package boundary

import (
	"os/exec"
	"testing"
)

// BenchmarkBubblewrapStart is what the boundary adds to a wrapper's start:
// bubblewrap with the wrapper's full command line running /usr/bin/true,
// beside the same exec without it and bubblewrap's floor (a user and PID
// namespace with one bind).
func BenchmarkBubblewrapStart(b *testing.B) {
	bw, err := FindBwrap("")
	if err != nil {
		b.Skip(err)
	}
	dir := b.TempDir()
	c := Config{Bwrap: bw, UID: -1, GID: -1}
	run := func(b *testing.B, name string, args func(*Files) []string) {
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				f, err := c.OpenFiles()
				if err != nil {
					b.Fatal(err)
				}
				var cmd *exec.Cmd
				if a := args(f); a == nil {
					cmd = exec.Command("/usr/bin/true")
				} else {
					cmd = exec.Command(bw, append(a, "/usr/bin/true")...)
					cmd.ExtraFiles = f.List()
				}
				if err := cmd.Run(); err != nil {
					b.Fatal(name, err)
				}
				f.Close()
			}
		})
	}
	run(b, "exec-only", func(*Files) []string { return nil })
	run(b, "bwrap-floor", func(*Files) []string {
		return []string{"--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--"}
	})
	run(b, "bwrap-boundary", func(f *Files) []string {
		return c.Args(Mount{Workspace: dir, Home: dir, Program: "/usr/bin/true"}, f, 3)
	})
}
