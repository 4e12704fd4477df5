package egress

import (
	"errors"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// A copy reads at most its buffer at a time: firstChunk to begin with, so
// a connection that trickles holds little, doubled after each read that
// filled it, up to maxChunk for a bulk transfer. On two cores a 50 MB
// loopback download by Go's HTTP client through a bare read/write relay
// ran at 0.80x direct with 32 KiB reads, 0.82-0.94x with 256 KiB, and
// 0.75x with 1 MiB; a relay that spliced through a pipe (the bytes never
// in user space) ran at 0.49-0.57x: on loopback, splice's page references
// cost more than the copy they save, and each splice moves at most a
// pipe's 64 KiB.
const (
	firstChunk = 32 << 10
	maxChunk   = 256 << 10
)

var errNotRaw = errors.New("egress: not a connection with a descriptor")

// copyCounted copies src to dst until src's end of stream. Each read of src
// is made on its descriptor when it is ready, so that it can reserve room
// for what it may take first (room: a byte bound stays a bound, and a copy
// waiting for data holds no reservation) and settle it after (took: the
// rest goes back, the idle clock); every chunk written to dst is reported
// (delivered: the byte counts). errNotRaw: src has no descriptor, nothing
// was copied.
func copyCounted(dst, src net.Conn, room func(int) int, took func(reserved, n int), delivered func(int)) error {
	rs, err := rawConn(src)
	if err != nil {
		return err
	}
	buf := make([]byte, firstChunk)
	for {
		n, err := readReserved(rs, buf, room, took)
		if err != nil || n == 0 {
			return err
		}
		k, err := dst.Write(buf[:n])
		delivered(k)
		if err != nil {
			return err
		}
		if n == len(buf) && len(buf) < maxChunk {
			buf = make([]byte, 2*len(buf))
		}
	}
}

// rawConn is c's descriptor, to read (or hand on) in Go's poller.
func rawConn(c net.Conn) (syscall.RawConn, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil, errNotRaw
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, errNotRaw
	}
	return rc, nil
}

// readReserved reads src's descriptor into buf once it is ready, waiting in
// Go's poller meanwhile; room is asked, and settled with took, on every
// attempt, so nothing is held while waiting. 0 and no error: end of stream.
func readReserved(rs syscall.RawConn, buf []byte, room func(int) int, took func(reserved, n int)) (int, error) {
	var n int
	var rerr error
	err := rs.Read(func(fd uintptr) bool {
		for {
			size := room(len(buf))
			n, rerr = unix.Read(int(fd), buf[:size])
			took(size, max(0, n))
			if rerr != unix.EINTR {
				return rerr != unix.EAGAIN
			}
		}
	})
	if err != nil {
		return 0, err
	}
	if rerr != nil {
		return 0, rerr
	}
	return n, nil
}
