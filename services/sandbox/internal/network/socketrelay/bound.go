package socketrelay

import (
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Bounds limit what one sandbox may hold of a socket handed into it, so a
// flood of connections from one sandbox cannot take the service's
// descriptors (issue 31: 20,000 held for 40 s).
type Bounds struct {
	// PerPeer is the most connections one peer holds open at once; past it
	// a new one is closed as soon as it is accepted. A peer is the PID
	// namespace of the connecting process: every sandbox has its own.
	PerPeer int
	// Idle closes a connection that read nothing this long (0: never).
	Idle time.Duration
}

// Bound wraps ln: its Accept returns only connections within b.
func Bound(ln net.Listener, b Bounds) net.Listener {
	return &bounded{Listener: ln, b: b, open: map[string]int{}}
}

type bounded struct {
	net.Listener
	b    Bounds
	mu   sync.Mutex
	open map[string]int
}

func (l *bounded) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		peer := PeerOf(c)
		l.mu.Lock()
		over := l.b.PerPeer > 0 && l.open[peer] >= l.b.PerPeer
		if !over {
			l.open[peer]++
		}
		l.mu.Unlock()
		if over {
			_ = c.Close()
			continue
		}
		return &boundConn{Conn: c, l: l, peer: peer}, nil
	}
}

func (l *bounded) release(peer string) {
	l.mu.Lock()
	if l.open[peer]--; l.open[peer] <= 0 {
		delete(l.open, peer)
	}
	l.mu.Unlock()
}

type boundConn struct {
	net.Conn
	l    *bounded
	peer string
	once sync.Once
}

func (c *boundConn) Read(p []byte) (int, error) {
	if c.l.b.Idle > 0 {
		_ = c.SetReadDeadline(time.Now().Add(c.l.b.Idle))
	}
	return c.Conn.Read(p)
}

// NetConn is the accepted connection itself (for code that needs the
// *net.UnixConn); closing this wrapper still releases the peer's slot.
func (c *boundConn) NetConn() net.Conn { return c.Conn }

func (c *boundConn) Close() error {
	c.once.Do(func() { c.l.release(c.peer) })
	return c.Conn.Close()
}

// CloseWrite passes a half-close on (relay.join uses it).
func (c *boundConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}

// PeerOf names the peer of a Unix connection: the PID namespace of the
// process that connected (SO_PEERCRED; the sandbox cannot forge it), else
// its cgroup, else its uid; "" when none can be read.
func PeerOf(c net.Conn) string {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return ""
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return ""
	}
	var cred *unix.Ucred
	_ = rc.Control(func(fd uintptr) {
		cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if err != nil || cred == nil {
		return ""
	}
	proc := "/proc/" + strconv.Itoa(int(cred.Pid))
	if ns, err := os.Readlink(proc + "/ns/pid"); err == nil {
		return ns
	}
	if cg, err := os.ReadFile(proc + "/cgroup"); err == nil {
		return "cgroup:" + string(cg)
	}
	return "uid:" + strconv.Itoa(int(cred.Uid))
}
