package egress

import (
	"bufio"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// meter is a sandbox-side connection with its bounds: it counts the bytes
// each way, and closes itself (and the upstream) when they pass MaxBytes
// or nothing moved for Idle, remembering why.
type meter struct {
	net.Conn
	lim      Limits
	up, down atomic.Int64
	last     atomic.Int64 // unix nanos of the last byte
	mu       sync.Mutex
	reason   string
	closers  []io.Closer
	done     chan struct{}
}

func newMeter(c net.Conn, lim Limits) *meter {
	m := &meter{Conn: c, lim: lim, done: make(chan struct{})}
	m.last.Store(time.Now().UnixNano())
	if lim.Idle > 0 {
		go m.watch()
	}
	return m
}

func (m *meter) watch() {
	tick := max(m.lim.Idle/4, 10*time.Millisecond)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-m.done:
			return
		case now := <-t.C:
			if now.Sub(time.Unix(0, m.last.Load())) >= m.lim.Idle {
				m.cut(ReasonIdleTimeout)
				return
			}
		}
	}
}

func (m *meter) stop() {
	select {
	case <-m.done:
	default:
		close(m.done)
	}
}

func (m *meter) Read(p []byte) (int, error) {
	n, err := m.Conn.Read(p)
	m.add(&m.up, n)
	return n, err
}

func (m *meter) Write(p []byte) (int, error) {
	n, err := m.Conn.Write(p)
	m.add(&m.down, n)
	return n, err
}

func (m *meter) add(c *atomic.Int64, n int) {
	if n <= 0 {
		return
	}
	c.Add(int64(n))
	m.last.Store(time.Now().UnixNano())
	if m.lim.MaxBytes > 0 && m.up.Load()+m.down.Load() > m.lim.MaxBytes {
		m.cut(ReasonBytesLimit)
	}
}

// touch restarts the idle clock: bytes are moving.
func (m *meter) touch() { m.last.Store(time.Now().UnixNano()) }

// room is how many of n bytes a copy may take next: at most one past the
// byte bound, so a connection that would carry more crosses it, and is cut,
// without the rest passing first.
func (m *meter) room(n int) int {
	if m.lim.MaxBytes <= 0 {
		return n
	}
	left := m.lim.MaxBytes - m.up.Load() - m.down.Load() + 1
	return int(max(1, min(int64(n), left)))
}

// toSandbox copies src (the upstream) to the sandbox side until src ends,
// spliced in the kernel when both are sockets, counting what was delivered.
func (m *meter) toSandbox(src net.Conn) {
	err := splice(m.Conn, src, m.room, m.touch, func(n int) { m.add(&m.down, n) })
	if errors.Is(err, errNotSpliceable) {
		_, _ = io.Copy(m, src)
	}
}

// fromSandbox copies the sandbox side to dst (the upstream) until it ends:
// first what br (which reads m, so counted it) holds, then the rest,
// spliced in the kernel when both are sockets.
func (m *meter) fromSandbox(dst net.Conn, br *bufio.Reader) {
	if b, _ := br.Peek(br.Buffered()); len(b) > 0 {
		if _, err := dst.Write(b); err != nil {
			return
		}
		_, _ = br.Discard(len(b))
	}
	err := splice(dst, m.Conn, m.room, m.touch, func(n int) { m.add(&m.up, n) })
	if errors.Is(err, errNotSpliceable) {
		_, _ = io.Copy(dst, br)
	}
}

// startCounting counts from here: of what was read so far, only the
// buffered bytes not yet consumed (they follow the preamble, so they are
// the runtime's).
func (m *meter) startCounting(buffered int) { m.up.Store(int64(buffered)); m.down.Store(0) }

func (m *meter) counts() (up, down int64) { return m.up.Load(), m.down.Load() }

// alsoClose makes a cut close c too.
func (m *meter) alsoClose(c io.Closer) {
	m.mu.Lock()
	m.closers = append(m.closers, c)
	m.mu.Unlock()
}

func (m *meter) cut(reason string) {
	m.mu.Lock()
	if m.reason == "" {
		m.reason = reason
	}
	closers := m.closers
	m.mu.Unlock()
	_ = m.Close()
	for _, c := range closers {
		_ = c.Close()
	}
}

func (m *meter) cutReason() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.reason
}
