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

// meter is the runtime's connection with its bounds: it counts the bytes
// each way and charges them to its sandbox's budget, and closes itself (and
// the upstream) when the budget is spent or nothing moved for idle,
// remembering why.
type meter struct {
	net.Conn
	budget   *budget
	idle     time.Duration
	up, down atomic.Int64
	last     atomic.Int64 // unix nanos of the last byte
	mu       sync.Mutex
	reason   string
	closers  []io.Closer
	done     chan struct{}
	// beforeCut runs once before a bound closes the connection (nil: none):
	// the proxy saves the window there, so the runtime that sees the cut
	// finds it counted by the next owner too.
	beforeCut func()
}

func newMeter(c net.Conn, b *budget, idle time.Duration, beforeCut func()) *meter {
	m := &meter{Conn: c, budget: b, idle: idle, done: make(chan struct{}), beforeCut: beforeCut}
	m.touch()
	if idle > 0 {
		go m.watch()
	}
	return m
}

func (m *meter) watch() {
	tick := max(m.idle/4, 10*time.Millisecond)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-m.done:
			return
		case now := <-t.C:
			if now.Sub(time.Unix(0, m.last.Load())) >= m.idle {
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
	m.count(&m.up, n, true)
	return n, err
}

func (m *meter) Write(p []byte) (int, error) {
	n, err := m.Conn.Write(p)
	m.count(&m.down, n, true)
	return n, err
}

// count adds n bytes to c, and to the budget unless a reservation already
// charged them.
func (m *meter) count(c *atomic.Int64, n int, charge bool) {
	if n <= 0 {
		return
	}
	c.Add(int64(n))
	m.touch()
	if charge {
		m.budget.charge(n)
	}
	if m.budget.spent() {
		m.cut(ReasonBytesLimit)
	}
}

// touch restarts the idle clock: bytes are moving.
func (m *meter) touch() { m.last.Store(time.Now().UnixNano()) }

// took settles a copy's reservation of reserved bytes of which it took n.
func (m *meter) took(reserved, n int) {
	m.budget.refund(reserved - n)
	if n > 0 {
		m.touch()
	}
}

// toSandbox copies src (the upstream) to the runtime until src ends,
// counting what was delivered.
func (m *meter) toSandbox(src net.Conn) {
	err := copyCounted(m.Conn, src, m.budget.reserve, m.took, func(n int) { m.count(&m.down, n, false) })
	if errors.Is(err, errNotRaw) {
		_, _ = io.Copy(m, src)
	}
}

// fromSandbox copies the runtime's side to dst (the upstream) until it
// ends: first what br (which reads m, so counted it) holds, then the rest.
func (m *meter) fromSandbox(dst net.Conn, br *bufio.Reader) {
	if b, _ := br.Peek(br.Buffered()); len(b) > 0 {
		if _, err := dst.Write(b); err != nil {
			return
		}
		_, _ = br.Discard(len(b))
	}
	err := copyCounted(dst, m.Conn, m.budget.reserve, m.took, func(n int) { m.count(&m.up, n, false) })
	if errors.Is(err, errNotRaw) {
		_, _ = io.Copy(dst, br)
	}
}

func (m *meter) counts() (up, down int64) { return m.up.Load(), m.down.Load() }

// alsoClose makes a cut close c too.
func (m *meter) alsoClose(c io.Closer) {
	m.mu.Lock()
	m.closers = append(m.closers, c)
	m.mu.Unlock()
}

func (m *meter) cut(reason string) {
	m.mu.Lock()
	first := m.reason == ""
	if first {
		m.reason = reason
	}
	closers := m.closers
	m.mu.Unlock()
	if first && m.beforeCut != nil {
		m.beforeCut()
	}
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
