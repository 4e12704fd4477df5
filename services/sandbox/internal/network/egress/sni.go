package egress

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"time"
)

// maxClientHello bounds what is read looking for the ClientHello: one TLS
// record (16 KiB plus its header) and a little.
const maxClientHello = 16<<10 + 512

var (
	errNotTLS    = errors.New("egress: not a TLS ClientHello")
	errHelloSeen = errors.New("egress: client hello read")
)

// ReadClientHello reads a TLS ClientHello from r and returns its SNI
// (empty when it names none) and every byte read, to be replayed to the
// upstream. crypto/tls does the parsing: it is the parser of record and
// the proxy never answers the handshake itself.
func ReadClientHello(r io.Reader) (sni string, raw []byte, err error) {
	var buf bytes.Buffer
	tee := io.TeeReader(io.LimitReader(r, maxClientHello), &buf)
	var hello *tls.ClientHelloInfo
	_ = tls.Server(readOnlyConn{tee}, &tls.Config{
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			hello = h
			return nil, errHelloSeen
		},
	}).Handshake()
	if hello == nil {
		return "", buf.Bytes(), errNotTLS
	}
	return hello.ServerName, buf.Bytes(), nil
}

// readOnlyConn is a net.Conn that reads r and writes nowhere (crypto/tls
// sends its alert on the way out; nothing of it reaches the client).
type readOnlyConn struct{ r io.Reader }

func (c readOnlyConn) Read(p []byte) (int, error)     { return c.r.Read(p) }
func (readOnlyConn) Write(p []byte) (int, error)      { return len(p), nil }
func (readOnlyConn) Close() error                     { return nil }
func (readOnlyConn) LocalAddr() net.Addr              { return nil }
func (readOnlyConn) RemoteAddr() net.Addr             { return nil }
func (readOnlyConn) SetDeadline(time.Time) error      { return nil }
func (readOnlyConn) SetReadDeadline(time.Time) error  { return nil }
func (readOnlyConn) SetWriteDeadline(time.Time) error { return nil }
