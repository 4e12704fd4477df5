package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// forwarder sends one request upstream and copies the response back, all on
// the handler goroutine, over a pool of keep-alive HTTP/1.1 connections.
// http.Transport hands every request to a per-connection write goroutine and
// every response back from a read goroutine; on a small shared machine those
// cross-thread wake-ups cost more than the proxy's own work (measured in
// docs/benchmarks.md, "credential proxy"). Like a bare RoundTripper it never
// follows redirects and never consults HTTP_PROXY.
type forwarder struct {
	dialer  net.Dialer
	maxIdle int           // idle connections kept per upstream host
	idleFor time.Duration // an idle connection older than this is closed, not reused
	// headerWait bounds the wait for an upstream's response head once the
	// request was sent; bodyIdle bounds each wait for response body bytes.
	// An upstream that never answers holds neither the caller nor a
	// descriptor longer than these.
	headerWait, bodyIdle time.Duration

	mu   sync.Mutex
	idle map[string][]*upstreamConn // by scheme://host
}

type upstreamConn struct {
	key  string
	conn net.Conn
	head *headLimit // under br: bounds what a response head may read, and each body read's wait
	br   *bufio.Reader
	bw   *bufio.Writer
	used time.Time // when it last went idle
}

func newForwarder() *forwarder {
	return &forwarder{
		dialer:  net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second},
		maxIdle: 512,
		idleFor: 60 * time.Second,
		idle:    map[string][]*upstreamConn{},
		// A model may think for minutes before its first byte (a
		// non-streamed completion); a stream sends at least keep-alives.
		headerWait: 10 * time.Minute,
		bodyIdle:   5 * time.Minute,
	}
}

// errAfterHeaders marks a failure once the response status was sent: the
// handler can only abort the response.
var errAfterHeaders = errors.New("upstream failed after the response started")

// errResponseHead: the upstream's response head was over the bounds.
var errResponseHead = errors.New("upstream response head too large")

// headLimit passes reads through to the connection; while on, it fails
// once more than left bytes were read (the response head plus what the
// bufio.Reader reads ahead of it). While off (the body), each read waits
// at most idle.
type headLimit struct {
	conn net.Conn
	on   bool
	left int
	idle time.Duration
	// cut is set once the caller went: no read extends the deadline then.
	cut atomic.Bool
}

// cancel fails the connection's reads and writes from now on.
func (l *headLimit) cancel() {
	l.cut.Store(true)
	_ = l.conn.SetDeadline(time.Unix(1, 0))
}

func (l *headLimit) Read(p []byte) (int, error) {
	if !l.on {
		if l.idle > 0 && !l.cut.Load() {
			_ = l.conn.SetReadDeadline(time.Now().Add(l.idle))
		}
		return l.conn.Read(p)
	}
	if l.left <= 0 {
		return 0, errResponseHead
	}
	if len(p) > l.left {
		p = p[:l.left]
	}
	n, err := l.conn.Read(p)
	l.left -= n
	return n, err
}

// readBufferSize is the upstream connection's read buffer.
const readBufferSize = 4 << 10

// forward sends out (an absolute-URL client request whose body is the
// caller's) and streams the filtered response to w. An error before anything
// was written to w leaves w untouched (the caller answers 502).
//
// g names what must never reach the caller (see echo.go): a response head
// holding it, over the header bounds or with a body the proxy cannot read
// is refused before anything is written (errEchoed, errResponseHead,
// errEncoded).
//
// tap, when not nil, reads the response's token usage and reports it before
// the body's last byte is sent.
func (f *forwarder) forward(ctx context.Context, w http.ResponseWriter, out *http.Request, g echoGuard, tap *usageTap) error {
	resp, uc, err := f.roundTrip(ctx, out)
	if err != nil {
		return err
	}
	if err := checkResponseHead(resp, g); err != nil {
		_ = resp.Body.Close()
		_ = uc.conn.Close()
		return err
	}
	// Cancellation of the caller (or a stalled upstream the caller gives up
	// on) unblocks the body copy by failing the connection.
	stop := context.AfterFunc(ctx, uc.head.cancel)
	FilterResponse(resp.Header)
	announceTrailers(w.Header(), resp)
	h := w.Header()
	for k, vs := range resp.Header {
		h[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	tap.start(resp)
	err = copyBody(ctx, w, resp, g, tap)
	FilterResponse(resp.Trailer)
	for k, vs := range resp.Trailer {
		if !g.inHeader(http.Header{k: vs}) {
			h[http.TrailerPrefix+k] = vs
		}
	}
	if !stop() || err != nil || resp.Close {
		_ = uc.conn.Close()
	} else {
		f.put(uc)
	}
	if err != nil {
		return errors.Join(errAfterHeaders, err)
	}
	return nil
}

// roundTrip writes out on a pooled (or new) connection and reads the
// response head. A request without a body that fails on a reused connection
// before any response byte is retried once on a new one: the upstream
// closed the idle connection meanwhile.
func (f *forwarder) roundTrip(ctx context.Context, out *http.Request) (*http.Response, *upstreamConn, error) {
	for attempt := 0; ; attempt++ {
		uc, reused, err := f.get(ctx, out.URL)
		if err != nil {
			return nil, nil, err
		}
		resp, err := exchange(ctx, uc, out, f.headerWait)
		if err == nil {
			return resp, uc, nil
		}
		_ = uc.conn.Close()
		if !reused || attempt > 0 || out.Body != nil || ctx.Err() != nil || errors.Is(err, errResponseHead) {
			return nil, nil, err
		}
	}
}

func exchange(ctx context.Context, uc *upstreamConn, out *http.Request, headerWait time.Duration) (*http.Response, error) {
	if headerWait > 0 { // sending the request and waiting for its answer's head
		_ = uc.conn.SetDeadline(time.Now().Add(headerWait))
	}
	stop := context.AfterFunc(ctx, func() { _ = uc.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if out.Body != nil {
		out.Body = &sendBeforeWait{ReadCloser: out.Body, bw: uc.bw}
	}
	if err := out.Write(headWriter{uc.bw}); err != nil {
		return nil, err
	}
	if err := uc.bw.Flush(); err != nil {
		return nil, err
	}
	uc.head.on, uc.head.left = true, MaxResponseHeaderBytes+readBufferSize
	defer func() { uc.head.on = false }()
	for {
		resp, err := http.ReadResponse(uc.br, out)
		if err != nil {
			return nil, err
		}
		switch {
		case resp.StatusCode == http.StatusSwitchingProtocols: // the proxy never forwards Upgrade
			return nil, errors.New("upstream switched protocols")
		case resp.StatusCode >= 100 && resp.StatusCode < 200: // 100 Continue, 103 Early Hints: skip
			continue
		}
		return resp, ctx.Err()
	}
}

// headWriter hides the *bufio.Writer from http.Request.Write, which would
// otherwise flush the request head on its own before a body: the head then
// leaves with the first body bytes, one write instead of two for the usual
// small request.
type headWriter struct{ bw *bufio.Writer }

func (w headWriter) Write(p []byte) (int, error)       { return w.bw.Write(p) }
func (w headWriter) WriteString(s string) (int, error) { return w.bw.WriteString(s) }
func (w headWriter) WriteByte(c byte) error            { return w.bw.WriteByte(c) }

// sendBeforeWait streams the caller's body: before each read after the
// first it sends everything buffered so far, so nothing read waits upstream
// for the caller's next bytes.
type sendBeforeWait struct {
	io.ReadCloser
	bw      *bufio.Writer
	started bool
}

func (b *sendBeforeWait) Read(p []byte) (int, error) {
	if b.started {
		if err := b.bw.Flush(); err != nil {
			return 0, err
		}
	}
	b.started = true
	return b.ReadCloser.Read(p)
}

// get returns an idle connection to u's host that is still open, or dials one.
func (f *forwarder) get(ctx context.Context, u *url.URL) (*upstreamConn, bool, error) {
	key := u.Scheme + "://" + u.Host
	now := time.Now()
	for {
		f.mu.Lock()
		list := f.idle[key]
		if len(list) == 0 {
			f.mu.Unlock()
			break
		}
		uc := list[len(list)-1]
		f.idle[key] = list[:len(list)-1]
		f.mu.Unlock()
		if now.Sub(uc.used) < f.idleFor && stillOpen(uc.conn) {
			return uc, true, nil
		}
		_ = uc.conn.Close()
	}
	conn, err := f.dial(ctx, u)
	if err != nil {
		return nil, false, err
	}
	return newUpstreamConn(key, conn, f.bodyIdle), false, nil
}

func newUpstreamConn(key string, conn net.Conn, bodyIdle time.Duration) *upstreamConn {
	head := &headLimit{conn: conn, idle: bodyIdle}
	return &upstreamConn{key: key, conn: conn, head: head, br: bufio.NewReaderSize(head, readBufferSize), bw: bufio.NewWriterSize(conn, 4<<10)}
}

func (f *forwarder) dial(ctx context.Context, u *url.URL) (net.Conn, error) {
	addr := u.Host
	if u.Port() == "" {
		if u.Scheme == "https" {
			addr = net.JoinHostPort(u.Hostname(), "443")
		} else {
			addr = net.JoinHostPort(u.Hostname(), "80")
		}
	}
	if u.Scheme == "https" {
		d := tls.Dialer{NetDialer: &f.dialer, Config: &tls.Config{ServerName: u.Hostname(), MinVersion: tls.VersionTLS12}}
		return d.DialContext(ctx, "tcp", addr)
	}
	return f.dialer.DialContext(ctx, "tcp", addr)
}

// stillOpen peeks without blocking: an idle keep-alive connection has
// nothing to read; EOF or stray bytes mean it must not be reused.
func stillOpen(c net.Conn) bool {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	open := false
	var b [1]byte
	if err := rc.Read(func(fd uintptr) bool {
		_, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		open = errors.Is(rerr, syscall.EAGAIN)
		return true
	}); err != nil {
		return false
	}
	return open
}

func (f *forwarder) put(uc *upstreamConn) {
	if uc.br.Buffered() > 0 { // bytes past the response: the connection is out of step
		_ = uc.conn.Close()
		return
	}
	_ = uc.conn.SetDeadline(time.Time{})
	uc.used = time.Now()
	f.mu.Lock()
	if len(f.idle[uc.key]) < f.maxIdle {
		f.idle[uc.key] = append(f.idle[uc.key], uc)
		uc = nil
	}
	f.mu.Unlock()
	if uc != nil {
		_ = uc.conn.Close()
	}
}

// closeIdle closes every idle connection.
func (f *forwarder) closeIdle() {
	f.mu.Lock()
	idle := f.idle
	f.idle = map[string][]*upstreamConn{}
	f.mu.Unlock()
	for _, list := range idle {
		for _, uc := range list {
			_ = uc.conn.Close()
		}
	}
}

// announceTrailers declares the upstream's trailers before the body so the
// server sends them after it.
func announceTrailers(h http.Header, resp *http.Response) {
	if len(resp.Trailer) == 0 {
		return
	}
	announced := resp.Trailer.Clone()
	FilterResponse(announced)
	names := make([]string, 0, len(announced))
	for k := range announced {
		names = append(names, k)
	}
	if len(names) > 0 {
		h.Add("Trailer", strings.Join(names, ", "))
	}
}

// checkResponseHead refuses a response head over the bounds, holding
// something g guards, or announcing a body encoding the proxy cannot scrub.
func checkResponseHead(resp *http.Response, g echoGuard) error {
	fields, size := headerSize(resp.Header)
	if tf, ts := headerSize(resp.Trailer); fields+tf > MaxResponseHeaders || size+ts > MaxResponseHeaderBytes {
		return errResponseHead
	}
	if g.inHeader(resp.Header) {
		return errEchoed
	}
	for _, ce := range resp.Header.Values("Content-Encoding") {
		for e := range strings.SplitSeq(ce, ",") {
			if e = strings.TrimSpace(e); e != "" && !strings.EqualFold(e, "identity") {
				return errEncoded
			}
		}
	}
	return nil
}

// copyBody streams resp's body to w through g's scrubber, flushing every
// chunk of a response of unknown length or an event stream (SSE) so the
// runtime sees it at once. With an active tap it reads the usage of what
// the caller gets and reports it before writing the chunk that completes
// it (the JSON body's last bracket, the usage event's end): the runtime
// cannot have read the usage, or ended its turn on it, before it is
// recorded.
func copyBody(ctx context.Context, w http.ResponseWriter, resp *http.Response, g echoGuard, tap *usageTap) error {
	defer resp.Body.Close()
	bp := copyBuffers.Get().(*[]byte)
	defer copyBuffers.Put(bp)
	buf := *bp
	rc := http.NewResponseController(w)
	flush := resp.ContentLength == -1 || strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	sc := scrubber{g: g}
	defer func() {
		if tap.active() { // the body failed before its usage: report what it carried
			tap.report(ctx)
		}
	}()
	for {
		n, rerr := resp.Body.Read(buf)
		out := sc.next(buf[:n], rerr == io.EOF)
		if tap.active() {
			_, _ = tap.r.Write(out)
			if rerr == io.EOF || tap.r.Done() {
				tap.report(ctx) // before the bytes that end the usage reach the caller
			}
		}
		if len(out) > 0 {
			if _, err := w.Write(out); err != nil {
				return err
			}
			if flush {
				if err := rc.Flush(); err != nil {
					return err
				}
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}

// callerBodyIdle bounds each wait for the caller's request body bytes: a
// caller that announces a body and stops sending holds nothing for long.
const callerBodyIdle = 2 * time.Minute

// idleBody extends the caller connection's read deadline before each read.
type idleBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	idle time.Duration
}

func (b *idleBody) Read(p []byte) (int, error) {
	_ = b.rc.SetReadDeadline(time.Now().Add(b.idle))
	return b.ReadCloser.Read(p)
}
