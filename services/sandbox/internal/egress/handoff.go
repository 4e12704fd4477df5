package egress

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"agentplane.dev/services/sandbox/internal/relay"
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
// the Unix connection: answerAccepted (it decides the connection: serves
// it, or refuses it on the socket) or answerNotOwner (it closed its copy
// unwritten; the wrapper, which still holds the socket, offers it to the
// next replica's socket).
const (
	answerAccepted byte = 'A'
	answerNotOwner byte = 'N'
)

var errHandoff = errors.New("egress: bad handoff")

// errNoHandoff: the connection closed without sending a byte, as a
// replica's start probing the directory's sockets does (relay.Listen): no
// decision to count.
var errNoHandoff = errors.New("egress: nothing handed off")

// ErrNotOwner is what an Authorizer returns for a wrapper whose sandbox
// another replica owns (or none does): the proxy answers answerNotOwner
// and leaves the runtime's connection to the next replica.
var ErrNotOwner = errors.New("egress: the wrapper's sandbox is not owned here")

// ReasonNoOwner is the wrapper's own answer, 503, when no proxy of the
// egress directory takes a connection: the sandbox's owner is restarting
// or being replaced. A package manager retries a 503, where a connection
// closed unanswered reads as a broken network. Nothing counts it: the
// decisions are the owner's, and there is none.
const ReasonNoOwner = "no_owner"

// Handoff is the wrapper's handler for each connection of its egress
// listener: it offers c as id to the proxies of dir in name order until one
// accepts it, and answers 503 no_owner when none does.
func Handoff(dir string, id Identity) func(net.Conn) {
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
	raw, err := rawConn(c)
	if err != nil {
		return false, err
	}
	socks, err := relay.Sockets(dir)
	if err != nil {
		return false, err
	}
	errs := []error{errHandoff}
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
	writeDenied(c, http.StatusServiceUnavailable, ReasonNoOwner)
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
		return false, errHandoff
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
		return false, errors.Join(errHandoff, serr)
	}
	_ = uc.SetReadDeadline(time.Now().Add(headerTimeout))
	var answer [1]byte
	if _, err := io.ReadFull(uc, answer[:]); err != nil {
		return false, err // refused (the proxy closed), or it may be serving: stop
	}
	switch answer[0] {
	case answerAccepted:
		return false, nil
	case answerNotOwner:
		return true, ErrNotOwner
	}
	return false, errHandoff
}

// receive reads a handoff from uc: one read that carries
// the whole preamble and exactly one descriptor, a connected TCP socket.
// Anything else is refused, and every descriptor it carried closed: no
// descriptor or more than one (the kernel discards those past the read's
// room, flagging MSG_CTRUNC), a pipe, a file, a datagram, Unix or listening
// socket, bytes past the line.
func receive(uc *net.UnixConn) (Identity, *net.TCPConn, error) {
	_ = uc.SetReadDeadline(time.Now().Add(headerTimeout))
	buf := make([]byte, maxPreamble+1)
	oob := make([]byte, unix.CmsgSpace(4)) // room for one descriptor (two, aligned)
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
	if n == 0 && oobn == 0 && (err == nil || errors.Is(err, io.EOF)) {
		return Identity{}, nil, errNoHandoff
	}
	fds := rights(oob[:oobn])
	if err != nil || flags&unix.MSG_CTRUNC != 0 || len(fds) != 1 {
		closeAll(fds)
		return Identity{}, nil, errHandoff
	}
	id, err := parsePreamble(buf[:n])
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
		return nil, errHandoff
	}
	f := os.NewFile(uintptr(fd), "egress-handoff")
	c, err := net.FileConn(f) // a dup of fd
	_ = f.Close()
	if err != nil {
		return nil, errHandoff
	}
	tc, ok := c.(*net.TCPConn)
	if !ok || tc.RemoteAddr() == nil { // a listener or an unconnected socket has no peer
		_ = c.Close()
		return nil, errHandoff
	}
	return tc, nil
}
