package boundary

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"agentplane.dev/pkg/ident"
	"agentplane.dev/services/sandbox/internal/agent/command"
)

// Isolation modes (SANDBOX_ISOLATION).
const (
	ModeNamespaces = "namespaces" // the default: bubblewrap namespaces, seccomp, no capabilities
	ModeNone       = "none"       // explicit only; wrappers share the service's uid, PID and network namespace
)

// InnerSocketDir is where the host's socket directory (Config.SocketDir)
// appears inside a sandbox: control/ holds the sandbox service replicas'
// control sockets, proxy/ the relays to the credential proxy.
const InnerSocketDir = "/run/agentplane"

// InnerHome is where the runtime key's home (Mount.Home) appears inside a
// sandbox, and the wrapper's and runtime's HOME there: like the workspace,
// never at its host path, so what an agent says of its own files (its
// global config, its data) does not name the host's layout.
const InnerHome = ident.SandboxOwnDir + "/home"

// InnerAgents is where the pinned agents' directory (Config.Agents)
// appears inside a sandbox: at a path of the sandbox's own, so that no
// session directory can overlap it (a service run from a checkout keeps
// its agents below the directory a user names: `agentplane dev` in the
// repository) and the host's layout stays out of the agent's view.
const InnerAgents = ident.SandboxOwnDir + "/agents"

// Config is how sandboxes are isolated.
type Config struct {
	// Bwrap is the bubblewrap binary.
	Bwrap string
	// Agents is the host directory of the pinned agents, bound read-only at
	// InnerAgents; empty: none.
	Agents string
	// ReadOnly are extra host paths bound read-only at the same path: the
	// installed agent runtimes (e.g. an agents/node_modules directory).
	ReadOnly []string
	// SocketDir is the host directory bound read-only at InnerSocketDir.
	SocketDir string
	// UID and GID run the sandbox as this host user (when the service is
	// root); -1 keeps the service's own.
	UID, GID int
	// Nested says the wrapper puts its runtime in the agent's nested
	// sandbox (NestedArgs), as the sandbox service always does: the
	// wrapper's own sandbox then lets bubblewrap through (the supervisor's
	// seccomp filter, no --disable-userns, bubblewrap bound in) and Probe
	// checks the nested sandbox too. Without it (tests of the outer
	// sandbox alone) the outer sandbox is the strict one.
	Nested bool
}

// Mount is what one wrapper sees besides the system directories.
type Mount struct {
	Workspace string // the host directory bound read-write at At
	// At is where the workspace appears inside the sandbox and the working
	// directory of the wrapper and its runtime: the route's directory, so
	// the agent, its tool calls and its history speak the session's paths,
	// never the host's layout (DESIGN.md 3.6). Empty: Workspace's own path.
	At      string
	Home    string // the host directory bound read-write at InnerHome, HOME inside
	Program string // the wrapper binary, bound read-only at the same path
}

// at is where the workspace is bound inside.
func (m Mount) at() string {
	if m.At == "" {
		return m.Workspace
	}
	return m.At
}

// Check reports why the workspace cannot be bound at m.At: a path every
// sandbox mounts itself (ident.ReservedDirectory: the system directories,
// /proc, /dev, /run, /etc, /tmp itself, InnerHome), or a path at, above or
// below another path this sandbox binds at its host path (the wrapper
// binary, bubblewrap, the read-only agent paths) — bound over one it would
// hide it, bound below one it would be made inside it.
func (c Config) Check(m Mount) error {
	at := m.at()
	if why := ident.ReservedDirectory(at); why != "" {
		return errors.New(why)
	}
	others := []string{m.Program}
	if c.Nested && !underSystemDirs(c.Bwrap) {
		others = append(others, c.Bwrap)
	}
	others = append(others, c.ReadOnly...)
	for _, p := range others {
		if p != "" && overlaps(at, p) {
			return fmt.Errorf("%s overlaps %s, which the sandbox binds itself", at, p)
		}
	}
	return nil
}

// overlaps reports whether one of two clean absolute paths is the other or
// below it.
func overlaps(a, b string) bool {
	a, b = filepath.Clean(a), filepath.Clean(b)
	return a == b || strings.HasPrefix(a, strings.TrimSuffix(b, "/")+"/") || strings.HasPrefix(b, strings.TrimSuffix(a, "/")+"/")
}

// etcFiles are the few files of /etc a runtime needs: the dynamic linker's
// cache, user and name-service lookups, time zone, TLS roots, git's and
// Debian's alternatives. Nothing else of /etc (no machine secrets).
var etcFiles = []string{
	"/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group",
	"/etc/nsswitch.conf", "/etc/hosts", "/etc/localtime", "/etc/ssl/certs", "/etc/ca-certificates",
	"/etc/pki", "/etc/alternatives", "/etc/gitconfig", "/etc/mime.types",
}

// systemDirs are bound read-only, or recreated as the same symlink when the
// host has merged /usr (Debian: /bin → usr/bin).
var systemDirs = []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"}

// Files are the descriptors a wrapper's bubblewrap inherits: the seccomp
// program, and the regular files of etcFiles, which bubblewrap copies into
// the sandbox's root (--file) instead of binding each one: every bind costs
// bubblewrap a mount, a remount and a read of mountinfo (~0.2 ms each, more
// under load: issue 16's cold-start goal), and the copy is fresh at every
// launch. Directories of etcFiles stay bound.
type Files struct {
	seccomp *os.File
	etc     []*os.File // each opened at its host path (Name)
}

// OpenFiles opens the files bubblewrap reads for one wrapper; Close them
// once the child has started.
func (c Config) OpenFiles() (*Files, error) {
	prog := SeccompProgram
	if c.Nested {
		prog = SupervisorSeccompProgram
	}
	sc, err := programFile(prog)
	if err != nil {
		return nil, err
	}
	f := &Files{seccomp: sc}
	for _, p := range etcFiles {
		if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() {
			continue
		}
		ef, err := os.Open(p)
		if err != nil {
			continue // as --ro-bind-try: a file that cannot be read is left out
		}
		f.etc = append(f.etc, ef)
	}
	return f, nil
}

// List is the descriptors in the order Args numbers them.
func (f *Files) List() []*os.File { return append([]*os.File{f.seccomp}, f.etc...) }

// Close closes the parent's copies.
func (f *Files) Close() {
	for _, x := range f.List() {
		_ = x.Close()
	}
}

// Args is bubblewrap's command line for one wrapper, up to and including
// "--"; f's descriptors are inherited as firstFD, firstFD+1, ... in List
// order.
//
// Order matters: bubblewrap applies the operations in turn, so /tmp is a
// fresh tmpfs before the workspace (which may live under /tmp) is bound,
// and the root (a tmpfs holding the copied /etc files and the mount points)
// is made read-only last. The workspace is bound at m.At (its mount point,
// and the directories above it, are made on that tmpfs) after everything
// else, and is the working directory; Check says whether m.At can be.
func (c Config) Args(m Mount, f *Files, firstFD int) []string {
	a := []string{
		"--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
		"--hostname", "sandbox",
		// No --die-with-parent: a wrapper outlives its sandbox service (it
		// reconnects to the replica that takes over, DESIGN 3.2).
		"--new-session", "--cap-drop", "ALL",
		"--seccomp", strconv.Itoa(firstFD),
	}
	if !c.Nested {
		a = append(a, "--disable-userns") // nested: the agent's bubblewrap disables them for the agent
	}
	for _, d := range systemDirs {
		fi, err := os.Lstat(d)
		switch {
		case err != nil:
		case fi.Mode()&os.ModeSymlink != 0:
			if target, err := os.Readlink(d); err == nil {
				a = append(a, "--symlink", target, d)
			}
		case fi.IsDir():
			a = append(a, "--ro-bind", d, d)
		}
	}
	copied := map[string]int{}
	for i, ef := range f.etc {
		copied[ef.Name()] = firstFD + 1 + i
	}
	for _, p := range etcFiles {
		if fd, ok := copied[p]; ok {
			a = append(a, "--file", strconv.Itoa(fd), p)
		} else if _, err := os.Stat(p); err == nil {
			a = append(a, "--ro-bind-try", p, p)
		}
	}
	a = append(a, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run")
	a = append(a, "--ro-bind", m.Program, m.Program)
	if c.Nested && !underSystemDirs(c.Bwrap) {
		a = append(a, "--ro-bind", c.Bwrap, c.Bwrap)
	}
	for _, p := range c.ReadOnly {
		a = append(a, "--ro-bind", p, p)
	}
	if c.Agents != "" {
		a = append(a, "--ro-bind", c.Agents, InnerAgents)
	}
	if c.SocketDir != "" {
		a = append(a, "--ro-bind", c.SocketDir, InnerSocketDir)
	}
	a = append(a, "--bind", m.Home, InnerHome, "--bind", m.Workspace, m.at(),
		"--remount-ro", "/", "--setenv", "TMPDIR", "/tmp", "--setenv", "HOME", InnerHome, "--chdir", m.at(), "--")
	return a
}

// underSystemDirs reports whether path is inside one of systemDirs (so
// already in every sandbox's view).
func underSystemDirs(path string) bool {
	for _, d := range systemDirs {
		if strings.HasPrefix(path, d+"/") {
			return true
		}
	}
	return false
}

// NestedArgs is the command line of the agent's nested sandbox (DESIGN.md
// 3.3 "The supervisor is out of the agent's reach"), up to and including
// "--", for the bubblewrap the wrapper runs its runtime with: new user, PID
// and IPC namespaces inside the wrapper's (the network namespace is shared:
// the runtime reaches the proxy and egress through the wrapper's loopback
// listeners), a fresh /proc that shows only the agent's own processes, no
// user namespaces below, no capabilities, the strict seccomp filter on
// seccompFD (stacked on the wrapper's), and the wrapper's filesystem view
// except /run, where the host's sockets (InnerSocketDir) are: the agent
// never sees the control sockets or the relays. The wrapper is not in the
// agent's PID namespace, so the agent cannot name it: no signal, ptrace or
// /proc read reaches it. When the wrapper dies, so does the nested sandbox
// (--die-with-parent), and killing its bubblewrap ends every process in it.
func NestedArgs(seccompFD int, dir string) []string {
	return []string{
		"--unshare-user", "--unshare-pid", "--unshare-ipc", "--disable-userns", "--die-with-parent",
		"--new-session", "--cap-drop", "ALL", "--seccomp", strconv.Itoa(seccompFD),
		"--bind", "/", "/", "--tmpfs", "/run", "--proc", "/proc", "--dev", "/dev", "--chdir", dir, "--",
	}
}

// SeccompFile returns a pipe's read end holding SeccompProgram, for a child
// to inherit (bubblewrap reads it to the end before it starts the wrapper).
func SeccompFile() (*os.File, error) { return programFile(SeccompProgram) }

func programFile(program func() ([]byte, error)) (*os.File, error) {
	prog, err := program()
	if err != nil {
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	_, werr := w.Write(prog) // a few hundred bytes: far below a pipe's buffer
	cerr := w.Close()
	if err := errors.Join(werr, cerr); err != nil {
		_ = r.Close()
		return nil, err
	}
	return r, nil
}

// Credential is the SysProcAttr credential that runs bubblewrap as the
// configured host user, or nil to keep the service's.
func (c Config) Credential() *syscall.Credential {
	if c.UID < 0 || os.Geteuid() != 0 {
		return nil
	}
	return &syscall.Credential{Uid: uint32(c.UID), Gid: uint32(c.GID), Groups: []uint32{}}
}

// probeDirectory is where Probe binds its workspace inside the sandbox.
const probeDirectory = ident.SandboxOwnDir + "/probe"

// Probe runs a command under exactly the namespaces, filesystem view and
// seccomp filter of a wrapper — with a workspace under the directory under
// and program (the wrapper binary; empty: none) bound as a wrapper's — and
// reports why it cannot when the host (the kernel, a container's seccomp
// profile, a missing binary, a path the sandbox user cannot reach) does not
// allow it.
func (c Config) Probe(ctx context.Context, under, program string) error {
	if c.Bwrap == "" {
		return errors.New("bubblewrap (bwrap) not found on PATH")
	}
	truePath, err := exec.LookPath("true")
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	if program == "" {
		program = truePath
	}
	dir, err := os.MkdirTemp(under, ".probe-")
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	defer os.RemoveAll(dir)
	if cred := c.Credential(); cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return fmt.Errorf("probe: %w", err)
		}
	}
	files, err := c.OpenFiles()
	if err != nil {
		return err
	}
	defer files.Close()
	probe := c
	if probe.SocketDir != "" {
		if _, err := os.Stat(probe.SocketDir); err != nil {
			probe.SocketDir = ""
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	// The workspace at a path of its own inside, as a route's directory is
	// (its mount point made on the sandbox's root).
	m := Mount{Workspace: dir, At: probeDirectory, Home: dir, Program: program}
	args := probe.Args(m, files, 3)
	extra := files.List()
	if c.Nested {
		// The agent's nested sandbox inside the wrapper's: its filter on
		// the descriptor after the outer one's files.
		inner, err := SeccompFile()
		if err != nil {
			return err
		}
		defer inner.Close()
		args = append(append(args, c.Bwrap), NestedArgs(3+len(extra), m.at())...)
		extra = append(extra, inner)
	}
	cmd := command.New(ctx, command.Spec{Path: c.Bwrap, Args: append(args, truePath), Env: []string{"PATH=/usr/bin:/bin"},
		ExtraFiles: extra, Credential: c.Credential()})
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(command.Stderr(cmd))
		if msg == "" {
			msg = err.Error()
		}
		if c.Nested && os.Geteuid() == 0 && c.Credential() == nil {
			// In a sandbox that maps host root, bubblewrap covers root's
			// writable /proc files, and the kernel then refuses the nested
			// sandbox a fresh /proc (and its uid map).
			msg += " (a sandbox that runs as host root cannot hold the agent's nested sandbox: run sandboxes as another uid, SANDBOX_UID)"
		}
		return fmt.Errorf("%s cannot set up a sandbox: %s", filepath.Base(c.Bwrap), msg)
	}
	return nil
}

// FindBwrap resolves the bubblewrap binary: path when set, else bwrap on PATH.
func FindBwrap(path string) (string, error) {
	if path == "" {
		path = "bwrap"
	}
	p, err := exec.LookPath(path)
	if err != nil {
		return "", fmt.Errorf("bubblewrap: %w", err)
	}
	return filepath.Abs(p)
}
