// Package egresshandoff is the egress handoff between a wrapper (inside the
// sandbox) and the sandbox service's egress proxies (on the host): the
// preamble line that names the wrapper, the descriptor passed with it, and
// the proxy's one-byte answer. The wrapper imports it for Handoff; the
// host's proxy (package egress) for Receive. It links nothing host-only, so
// the binary that runs in every sandbox carries no proxy and no metrics.
package egresshandoff

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"agentplane.dev/services/sandbox/internal/network/socketrelay"
)

// The handoff. Inside the sandbox, the wrapper's egress listener accepts
// the runtime's loopback connection and passes the socket itself to the
// proxy over a Unix socket of the egress directory: its preamble and the
// descriptor (SCM_RIGHTS) in one sendmsg. The wrapper then closes its copy
// and the proxy serves the runtime's connection directly, so no byte of the
// traffic crosses the wrapper (decisions.md #47).
//
// Every sandbox-service replica of the node serves a socket there, and only
// the one that owns the wrapper's sandbox can authenticate it. So before it
// touches the handed socket, a proxy answers the handoff with one byte on
// the Unix connection: AnswerAccepted (it decides the connection: serves
// it, or refuses it on the socket) or AnswerNotOwner (it closed its copy
// unwritten; the wrapper, which still holds the socket, offers it to the
// next replica's socket).
const (
	AnswerAccepted byte = 'A'
	AnswerNotOwner byte = 'N'
)

// Timeout bounds a handoff's wait for the other side: the proxy's answer,
// the wrapper's line (the proxy's header timeout).
const Timeout = 10 * time.Second

// ErrBad is a handoff refused: not one connected TCP socket with one well-formed line.
var ErrBad = errors.New("egress: bad handoff")

// ErrNothing: the connection closed without sending a byte, as a
// replica's start probing the directory's sockets does (relay.Listen): no
// decision to count.
var ErrNothing = errors.New("egress: nothing handed off")

// errNotOwner: a proxy answered AnswerNotOwner; the next one is offered
// the connection.
var errNotOwner = errors.New("egress: the wrapper's sandbox is not owned there")

// ReasonNoOwner is the wrapper's own answer, 503, when no proxy of the
// egress directory takes a connection: the sandbox's owner is restarting
// or being replaced. A package manager retries a 503, where a connection
// closed unanswered reads as a broken network. Nothing counts it: the
// decisions are the owner's, and there is none.
const ReasonNoOwner = "no_owner"

// Handler is the wrapper's handler for each connection of its egress
// listener: it offers c as id to the proxies of dir in name order until one
// accepts it, and answers 503 no_owner when none does.
func Handler(dir string, id Identity) func(net.Conn) {
	line, lineErr := preambleLine(id)
	return func(c net.Conn) {
		defer c.Close()
		if lineErr != nil {
			return
		}
		if offered, _ := handOff(dir, line, c); !offered {
			answerNoOwner(c)
		}
	}
}

// handOff offers c to each proxy of dir in turn; offered: one took it, or
// may hold it, so the wrapper must not write to c.
func handOff(dir string, line []byte, c net.Conn) (offered bool, err error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false, ErrBad
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return false, err
	}
	socks, err := socketrelay.Sockets(dir)
	if err != nil {
		return false, err
	}
	errs := []error{ErrBad}
	for _, s := range socks {
		next, err := offer(s, line, raw)
		if !next {
			return true, err
		}
		errs = append(errs, err)
	}
	return false, errors.Join(errs...)
}

// answerNoOwner writes the 503 without reading the request, then reads
// what the runtime sent for a moment (up to its close, a second or 64 KiB):
// closing a socket with its request unread resets the connection, and the
// reset can overtake the answer.
func answerNoOwner(c net.Conn) {
	const linger, drain = time.Second, 64 << 10
	_ = c.SetDeadline(time.Now().Add(linger))
	WriteDenied(c, http.StatusServiceUnavailable, ReasonNoOwner)
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(c, drain))
}

// offer hands raw's socket to the proxy at path and waits for its answer;
// next: that proxy did not take it (no replica there any more, or not the
// owner), so another may. Once a proxy may hold the socket (a send that
// went out, an answer not read), no other is offered it.
func offer(path string, line []byte, raw syscall.RawConn) (next bool, err error) {
	pc, err := net.Dial("unix", path)
	if err != nil {
		return true, err // a replica gone: its socket stays until the next one listens
	}
	defer pc.Close()
	uc, ok := pc.(*net.UnixConn)
	if !ok {
		return false, ErrBad
	}
	var n int
	var serr error
	// Inside Control the descriptor cannot be closed under the sendmsg.
	if err := raw.Control(func(fd uintptr) {
		n, _, serr = uc.WriteMsgUnix(line, unix.UnixRights(int(fd)), nil)
	}); err != nil {
		return false, err
	}
	if serr != nil || n != len(line) {
		return false, errors.Join(ErrBad, serr)
	}
	_ = uc.SetReadDeadline(time.Now().Add(Timeout))
	var answer [1]byte
	if _, err := io.ReadFull(uc, answer[:]); err != nil {
		return false, err // refused (the proxy closed), or it may be serving: stop
	}
	switch answer[0] {
	case AnswerAccepted:
		return false, nil
	case AnswerNotOwner:
		return true, errNotOwner
	}
	return false, ErrBad
}

// Receive reads a handoff from uc: one read that carries
// the whole preamble and exactly one descriptor, a connected TCP socket.
// Anything else is refused, and every descriptor it carried closed: no
// descriptor or more than one (the kernel discards those past the read's
// room, flagging MSG_CTRUNC), a pipe, a file, a datagram, Unix or listening
// socket, bytes past the line.
func Receive(uc *net.UnixConn) (Identity, *net.TCPConn, error) {
	_ = uc.SetReadDeadline(time.Now().Add(Timeout))
	buf := make([]byte, maxPreamble+1)
	oob := make([]byte, unix.CmsgSpace(4)) // room for one descriptor (two, aligned)
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
	if n == 0 && oobn == 0 && (err == nil || errors.Is(err, io.EOF)) {
		return Identity{}, nil, ErrNothing
	}
	fds := rights(oob[:oobn])
	if err != nil || flags&unix.MSG_CTRUNC != 0 || len(fds) != 1 {
		closeAll(fds)
		return Identity{}, nil, ErrBad
	}
	id, err := Parse(buf[:n])
	if err != nil {
		closeAll(fds)
		return Identity{}, nil, err
	}
	c, err := runtimeConn(fds[0])
	if err != nil {
		return Identity{}, nil, err
	}
	return id, c, nil
}

// rights are the descriptors of every SCM_RIGHTS message of oob.
func rights(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil // a truncated message's descriptors: none installed
	}
	var fds []int
	for _, m := range msgs {
		if got, err := unix.ParseUnixRights(&m); err == nil {
			fds = append(fds, got...)
		}
	}
	return fds
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// runtimeConn takes fd over: a connected TCP socket becomes the runtime's
// connection; anything else is closed and refused.
func runtimeConn(fd int) (*net.TCPConn, error) {
	proto, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL)
	if err != nil || (proto != unix.IPPROTO_TCP && proto != unix.IPPROTO_MPTCP) {
		_ = unix.Close(fd)
		return nil, ErrBad
	}
	f := os.NewFile(uintptr(fd), "egress-handoff")
	c, err := net.FileConn(f) // a dup of fd
	_ = f.Close()
	if err != nil {
		return nil, ErrBad
	}
	tc, ok := c.(*net.TCPConn)
	if !ok || tc.RemoteAddr() == nil { // a listener or an unconnected socket has no peer
		_ = c.Close()
		return nil, ErrBad
	}
	return tc, nil
}

// preambleMagic starts the one line a wrapper sends with every runtime
// connection it hands off: which wrapper it is, proven with its launch
// credential (the same proof as its control stream's Hello). The socket is
// reachable from every sandbox of the node, so the proxy learns whose
// policy applies from this line and nothing else.
const preambleMagic = "AGENTPLANE-EGRESS/1"

// maxPreamble bounds the line (ids are at most 64 bytes, the credential is
// short).
const maxPreamble = 1024

// Identity is the wrapper behind an egress connection.
type Identity struct {
	SandboxID, Instance, Credential string
}

var errPreamble = errors.New("egress: bad preamble")

// preambleLine is id's line, newline included.
func preambleLine(id Identity) ([]byte, error) {
	line := preambleMagic + " " + id.SandboxID + " " + id.Instance + " " +
		base64.RawURLEncoding.EncodeToString([]byte(id.Credential)) + "\n"
	if len(line) > maxPreamble || strings.Count(line, " ") != 3 || strings.Count(line, "\n") != 1 {
		return nil, errPreamble
	}
	return []byte(line), nil
}

// Parse reads b, all a handoff carried: exactly one line.
func Parse(b []byte) (Identity, error) {
	line, ok := bytes.CutSuffix(b, []byte("\n"))
	if !ok || len(b) > maxPreamble || bytes.IndexByte(line, '\n') >= 0 {
		return Identity{}, errPreamble
	}
	f := strings.Split(string(line), " ")
	if len(f) != 4 || f[0] != preambleMagic || f[1] == "" || f[2] == "" {
		return Identity{}, errPreamble
	}
	cred, err := base64.RawURLEncoding.Strict().DecodeString(f[3]) // one encoding per credential
	if err != nil || len(cred) == 0 {
		return Identity{}, errPreamble
	}
	return Identity{SandboxID: f[1], Instance: f[2], Credential: string(cred)}, nil
}

// WriteDenied writes a refusal as an HTTP response naming its reason in
// X-Agentplane-Egress: the proxy's denials and the wrapper's 503 no_owner.
func WriteDenied(w io.Writer, code int, reason string) {
	body := "agentplane egress: denied (" + reason + ")\n"
	_, _ = fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nX-Agentplane-Egress: %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s",
		code, http.StatusText(code), reason, len(body), body)
}
