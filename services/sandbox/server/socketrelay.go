package server

import (
	"net"
	"os"
	"path/filepath"

	"agentplane.dev/services/sandbox/internal/network/socketrelay"
)

// socketRelay is one way out of the boundary: a Unix socket under
// <root>/.sockets (inside a sandbox, under boundary.InnerSocketDir) whose
// connections the sandbox service carries to an address outside.
type socketRelay struct {
	ln   net.Listener
	done chan struct{}
}

// serveRelay listens at path and joins each connection to one from dial.
func serveRelay(path string, bounds socketrelay.Bounds, dial func() (net.Conn, error)) (*socketRelay, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	ln, err := socketrelay.Listen(path)
	if err != nil {
		return nil, err
	}
	ln = socketrelay.Bound(ln, bounds)
	r := &socketRelay{ln: ln, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		socketrelay.Serve(ln, dial)
	}()
	return r, nil
}

// close stops accepting and waits for the joined connections to end.
func (r *socketRelay) close() {
	if r != nil {
		_ = r.ln.Close()
		<-r.done
	}
}
