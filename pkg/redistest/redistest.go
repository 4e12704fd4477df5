// Package redistest runs a private redis-server for tests.
//
// Each Server owns one redis-server process, listening on an ephemeral
// 127.0.0.1 port (never 6379) or on a Unix socket in a temporary directory,
// with persistence off by default (--save "" --appendonly no). The address
// stays the same across Kill/Stop/Start/Restart so that existing clients
// reconnect by themselves, which is what fault tests need.
//
// A missing redis-server binary fails the test (never skips): install it with
// `apt-get install redis-server`.
package redistest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/testaddr"
)

// Binary is the redis-server executable looked up on PATH.
const Binary = "redis-server"

// startTimeout bounds how long a redis-server may take to answer PING.
const startTimeout = 15 * time.Second

// Persistence says whether Restart keeps the dataset.
type Persistence int

const (
	// DropData restarts with an empty dataset, like a crash of a server
	// without persistence.
	DropData Persistence = iota
	// KeepData saves a snapshot (SHUTDOWN SAVE) and loads it on start.
	KeepData
)

// Option configures a Server.
type Option func(*config)

type config struct {
	unix     bool
	args     []string
	sentinel *sentinelConf
	port     int  // 0: a free port the kernel picks
	ownGroup bool // the server in a process group of its own
}

// WithPort makes the server listen on port instead of a free one.
func WithPort(port int) Option { return func(c *config) { c.port = port } }

// WithOwnProcessGroup starts the server in a process group of its own, so a
// terminal's Ctrl-C (SIGINT to the foreground group) does not reach it and
// its owner decides when it stops (agentplane dev stops it last).
func WithOwnProcessGroup() Option { return func(c *config) { c.ownGroup = true } }

// sentinelConf makes the server a sentinel monitoring master.
type sentinelConf struct{ name, addr string }

// withSentinel runs the server as a sentinel (redis-server --sentinel)
// monitoring the master at addr under name, quorum 2, down-after 1s.
func withSentinel(name, addr string) Option {
	return func(c *config) { c.sentinel = &sentinelConf{name: name, addr: addr} }
}

// WithUnixSocket makes the server listen on a Unix socket instead of TCP.
func WithUnixSocket() Option { return func(c *config) { c.unix = true } }

// WithArgs appends raw redis-server arguments, e.g. "--maxmemory", "10mb".
func WithArgs(args ...string) Option {
	return func(c *config) { c.args = append(c.args, args...) }
}

// Server is one private redis-server process.
type Server struct {
	cfg  config
	dir  string
	port int    // TCP port, 0 with a Unix socket
	sock string // Unix socket path, "" with TCP

	mu      sync.Mutex
	release func() // the port's reservation (testaddr), until Close
	cmd     *exec.Cmd
	exited  chan struct{} // closed when cmd has been reaped
}

// Start starts a server for tb and stops it in tb.Cleanup.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	dir := tb.TempDir()
	s, err := New(dir, opts...)
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	tb.Cleanup(func() { _ = s.Close() })
	return s
}

// StartMain starts a server for a whole test package from TestMain. It
// returns the server and a function that stops it and removes its
// directory. On failure it prints the reason and exits with status 1, since
// TestMain has no testing.TB to fail.
func StartMain(opts ...Option) (*Server, func()) {
	dir, err := os.MkdirTemp("", "redistest-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "redistest: %v\n", err)
		os.Exit(1)
	}
	s, err := New(dir, opts...)
	if err != nil {
		_ = os.RemoveAll(dir)
		fmt.Fprintf(os.Stderr, "redistest: %v\n", err)
		os.Exit(1)
	}
	return s, func() {
		_ = s.Close()
		_ = os.RemoveAll(dir)
	}
}

// New starts a server whose files live in dir. The caller must Close it.
func New(dir string, opts ...Option) (*Server, error) {
	if _, err := exec.LookPath(Binary); err != nil {
		return nil, fmt.Errorf("%s not found on PATH (install it: apt-get install redis-server): %w", Binary, err)
	}
	s := &Server{dir: dir}
	for _, o := range opts {
		o(&s.cfg)
	}
	if s.cfg.unix {
		// Socket paths are limited to ~108 bytes; t.TempDir paths can be
		// longer, so fall back to a short directory of our own.
		s.sock = filepath.Join(dir, "redis.sock")
		if len(s.sock) > 100 {
			short, err := os.MkdirTemp("", "rt")
			if err != nil {
				return nil, fmt.Errorf("socket dir: %w", err)
			}
			s.sock = filepath.Join(short, "r.sock")
		}
		if err := s.start(); err != nil {
			return nil, err
		}
		return s, nil
	}
	if s.cfg.port != 0 {
		s.port = s.cfg.port
		if err := s.start(); err != nil {
			return nil, err
		}
		return s, nil
	}
	// The port stays reserved (testaddr) until Close, also across restarts;
	// a process that takes no part in reservations may still hold it: retry
	// with another.
	var err error
	for range 5 {
		port, release, rerr := testaddr.Reserve()
		if rerr != nil {
			return nil, rerr
		}
		s.port, s.release = port, release
		if err = s.start(); err == nil {
			return s, nil
		}
		release()
	}
	return nil, err
}

// Addr is the address to dial: host:port, or the socket path.
func (s *Server) Addr() string {
	if s.sock != "" {
		return s.sock
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Network is "tcp" or "unix".
func (s *Server) Network() string {
	if s.sock != "" {
		return "unix"
	}
	return "tcp"
}

// URL is a redis:// or unix:// URL accepted by redis.ParseURL.
func (s *Server) URL() string {
	if s.sock != "" {
		return "unix://" + s.sock
	}
	return "redis://" + s.Addr()
}

// Options returns fresh client options for this server.
func (s *Server) Options() *redis.Options {
	return &redis.Options{Network: s.Network(), Addr: s.Addr()}
}

// Client returns a client that is closed in tb.Cleanup.
func (s *Server) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(s.Options())
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Dir is the server's working directory (dump.rdb, redis.log).
func (s *Server) Dir() string { return s.dir }

// Start starts the server again after Kill or Stop, on the same address.
func (s *Server) Start(tb testing.TB) {
	tb.Helper()
	if err := s.start(); err != nil {
		tb.Fatalf("redistest: %v", err)
	}
}

// Restart stops the server and starts it again on the same address. With
// KeepData the dataset is saved on shutdown and loaded on start; with
// DropData the server is killed and starts empty.
func (s *Server) Restart(tb testing.TB, p Persistence) {
	tb.Helper()
	if err := s.restart(p); err != nil {
		tb.Fatalf("redistest: restart: %v", err)
	}
}

func (s *Server) restart(p Persistence) error {
	switch p {
	case KeepData:
		if err := s.shutdown("SAVE"); err != nil {
			return err
		}
	default:
		if err := s.Kill(); err != nil {
			return err
		}
		if err := os.Remove(filepath.Join(s.dir, "dump.rdb")); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("drop data: %w", err)
		}
	}
	return s.start()
}

// Kill sends SIGKILL and waits for the process to exit. Nothing is saved.
func (s *Server) Kill() error { return s.signalAndWait(syscall.SIGKILL) }

// Stop shuts the server down without saving and waits for it to exit.
func (s *Server) Stop() error { return s.shutdown("NOSAVE") }

// Pause freezes the server with SIGSTOP: connections stay open but nothing
// is answered, like a long GC pause or a network partition.
func (s *Server) Pause() error { return s.signal(syscall.SIGSTOP) }

// Resume undoes Pause with SIGCONT.
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT) }

// Running reports whether the process is alive (it may be paused).
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return false
	}
	select {
	case <-s.exited:
		return false
	default:
		return true
	}
}

// Close kills the server if it is running. Safe to call more than once.
func (s *Server) Close() error {
	err := s.Kill()
	s.mu.Lock()
	if s.release != nil {
		s.release()
		s.release = nil
	}
	s.mu.Unlock()
	if s.sock != "" && filepath.Dir(s.sock) != s.dir {
		_ = os.RemoveAll(filepath.Dir(s.sock))
	}
	return err
}

func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		select {
		case <-s.exited:
		default:
			return errors.New("server already running")
		}
	}
	logFile := filepath.Join(s.dir, "redis.log")
	args := []string{
		"--bind", "127.0.0.1",
		"--port", strconv.Itoa(s.port),
		"--dir", s.dir,
		"--dbfilename", "dump.rdb",
		"--save", "",
		"--appendonly", "no",
		"--logfile", logFile,
		"--daemonize", "no",
		"--protected-mode", "yes",
	}
	if s.sock != "" {
		args = append(args, "--unixsocket", s.sock, "--unixsocketperm", "700")
	}
	args = append(args, s.cfg.args...)
	if sc := s.cfg.sentinel; sc != nil {
		// A sentinel rewrites its config file (what it learned survives a
		// restart); it takes no persistence options.
		conf := filepath.Join(s.dir, "sentinel.conf")
		if _, err := os.Stat(conf); errors.Is(err, os.ErrNotExist) {
			host, port, _ := strings.Cut(sc.addr, ":")
			text := fmt.Sprintf("sentinel monitor %[1]s %[2]s %[3]s 2\nsentinel down-after-milliseconds %[1]s 1000\n"+
				"sentinel failover-timeout %[1]s 10000\nsentinel parallel-syncs %[1]s 1\n", sc.name, host, port)
			if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
				return err
			}
		}
		args = []string{conf, "--sentinel", "--bind", "127.0.0.1", "--port", strconv.Itoa(s.port),
			"--dir", s.dir, "--logfile", logFile, "--daemonize", "no", "--protected-mode", "no"}
	}
	cmd := exec.Command(Binary, args...)
	// Kill redis with us if the test binary dies without running cleanups.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: s.cfg.ownGroup}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", Binary, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	s.cmd, s.exited = cmd, exited

	if err := s.waitReady(exited); err != nil {
		_ = cmd.Process.Kill()
		<-exited
		logTail, _ := os.ReadFile(logFile)
		if len(logTail) > 2000 {
			logTail = logTail[len(logTail)-2000:]
		}
		return fmt.Errorf("%s on %s: %w\noutput: %s\nlog: %s", Binary, s.Addr(), err, out.String(), logTail)
	}
	return nil
}

func (s *Server) waitReady(exited <-chan struct{}) error {
	c := redis.NewClient(&redis.Options{
		Network: s.Network(), Addr: s.Addr(), MaxRetries: -1,
		DialTimeout: time.Second, ReadTimeout: time.Second,
	})
	defer c.Close()
	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-exited:
			return errors.New("exited during start")
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %v: %w", startTimeout, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// running returns the redis-server process and its exit channel, or a nil
// cmd when it was never started or has exited.
func (s *Server) running() (*exec.Cmd, chan struct{}) {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	if cmd == nil {
		return nil, nil
	}
	select {
	case <-exited:
		return nil, nil
	default:
		return cmd, exited
	}
}

// shutdown asks redis to exit with SHUTDOWN SAVE|NOSAVE and waits for it.
func (s *Server) shutdown(mode string) error {
	cmd, exited := s.running()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(syscall.SIGCONT) // a paused server cannot shut down
	c := redis.NewClient(&redis.Options{Network: s.Network(), Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	// SHUTDOWN closes the connection, so an error here is expected.
	err := c.Do(ctx, "SHUTDOWN", mode).Err()
	select {
	case <-exited:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("shutdown %s did not finish (last error: %w): %w", mode, err, ctx.Err())
	}
}

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return errors.New("server not started")
	}
	select {
	case <-s.exited:
		return errors.New("server not running")
	default:
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %v: %w", sig, err)
	}
	return nil
}

func (s *Server) signalAndWait(sig syscall.Signal) error {
	cmd, exited := s.running()
	if cmd == nil {
		return nil
	}
	if err := cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("signal %v: %w", sig, err)
	}
	<-exited
	return nil
}

// StartPair starts a master and one replica of it, and returns once the
// replica's link is up (for tests of replication.Policy: Pause the replica
// and writes cannot be confirmed).
func StartPair(tb testing.TB) (master, replica *Server) {
	tb.Helper()
	master = Start(tb)
	host, port, _ := strings.Cut(master.Addr(), ":")
	replica = Start(tb, WithArgs("--replicaof", host, port))
	rc := replica.Client(tb)
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, err := rc.Info(context.Background(), "replication").Result()
		if err == nil && strings.Contains(info, "master_link_status:up") {
			return master, replica
		}
		if time.Now().After(deadline) {
			tb.Fatalf("redistest: the replica's link to %s is not up: %v", master.Addr(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
