// Package socketrelay joins byte streams across the sandbox boundary: inside a
// sandbox, the wrapper offers the credential proxy on the sandbox's own
// loopback and carries each connection to a Unix socket handed in; outside,
// the sandbox service carries that socket to the proxy's network address.
// It copies bytes and knows nothing of HTTP.
package socketrelay

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
)

// Serve accepts connections on ln until ln is closed and joins each to a
// connection from dial. Closing ln ends the joined connections too, both
// ends (a caller that half-closed its side leaves the join waiting on the
// upstream's, which may never end by itself); Serve returns once they have.
func Serve(ln net.Listener, dial func() (net.Conn, error)) {
	accept(ln, func(stop context.Context, c net.Conn) { join(stop, c, dial) })
}

// Accept accepts connections on ln until ln is closed and runs handle for
// each on its own goroutine. Closing ln closes the connections still open;
// Accept returns once every handle has.
func Accept(ln net.Listener, handle func(net.Conn)) {
	accept(ln, func(_ context.Context, c net.Conn) { handle(c) })
}

// accept is Accept whose handlers also get a context that ends when ln is
// closed, before their connections are: what else a handler holds open
// (an upstream connection) it closes then.
func accept(ln net.Listener, handle func(stop context.Context, c net.Conn)) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		open = map[net.Conn]bool{}
	)
	stop, stopped := context.WithCancel(context.Background())
	defer func() {
		stopped()
		mu.Lock()
		for c := range open {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		mu.Lock()
		open[c] = true
		mu.Unlock()
		wg.Go(func() {
			handle(stop, c)
			mu.Lock()
			delete(open, c)
			mu.Unlock()
		})
	}
}

// join copies bytes both ways between c and a connection from dial until
// both directions end, or stop does (then both connections are closed).
func join(stop context.Context, c net.Conn, dial func() (net.Conn, error)) {
	defer c.Close()
	up, err := dial()
	if err != nil {
		return
	}
	defer up.Close()
	defer context.AfterFunc(stop, func() { _ = up.Close(); _ = c.Close() })()
	done := make(chan error, 2)
	pipe := func(dst, src net.Conn) {
		_, err := io.Copy(dst, src)
		closeWrite(dst) // pass the half-close on: HTTP/1.0 bodies end with it
		done <- err
	}
	go pipe(up, c)
	go pipe(c, up)
	if err := <-done; err != nil {
		// A broken side (or Serve closing c) ends both directions at once.
		_ = c.Close()
		_ = up.Close()
	}
	<-done //nolint:errcheck // the other direction's end: its error adds nothing
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// DialDir dials the Unix sockets in dir in name order and returns the first
// that answers: every live sandbox-service replica of this node serves one,
// and any of them carries the bytes to the same place.
func DialDir(dir string) (net.Conn, error) {
	names, err := Sockets(dir)
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, n := range names {
		c, err := net.Dial("unix", n)
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil, errors.New("relay: no socket in " + dir)
	}
	return nil, errors.Join(errs...)
}

// Sockets lists the *.sock files of dir, sorted.
func Sockets(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".sock") {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	sort.Strings(out)
	return out, nil
}

// Listen binds a Unix socket at path that any local user may connect to
// (a sandbox runs as its own user; what the socket leads to authenticates
// on its own), replacing a stale one. It first removes every socket of the
// directory that refuses connections: their replicas are gone.
func Listen(path string) (net.Listener, error) {
	if names, err := Sockets(filepath.Dir(path)); err == nil {
		for _, n := range names {
			if c, err := net.Dial("unix", n); err == nil {
				_ = c.Close()
			} else if errors.Is(err, syscall.ECONNREFUSED) {
				_ = os.Remove(n)
			}
		}
	}
	_ = os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o666); err != nil {
		_ = ln.Close()
		return nil, err
	}
	return ln, nil
}
