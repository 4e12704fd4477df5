package egress_test

import (
	"encoding/binary"
	"fmt"
	"net"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// sockmapForwarder is the benchmark's reference for a relay in the kernel:
// each accepted connection and its upstream are joined in a BPF sockhash
// whose stream verdict redirects every segment one receives to the other's
// send queue, so the relay never wakes for data. It carries no policy and
// no bounds (its only count is the bytes each socket redirected), and it
// ends a connection only when the client closes, which is all a download
// of a known length needs. The request is read before the join and written
// after it: a segment already queued when a socket joins is not redirected
// until the next one arrives, and a client waiting for its answer sends
// none.
type sockmapForwarder struct {
	socks, peers *ebpf.Map
}

// newSockmapForwarder loads the verdict program: look up the receiving
// socket's cookie in peers ({bytes, peer cookie}), add the segment's
// length to bytes, redirect to the peer's socket in socks; a socket with
// no peer passes its data to user space.
func newSockmapForwarder(b *testing.B) (*sockmapForwarder, error) {
	socks, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SockHash, KeySize: 8, ValueSize: 8, MaxEntries: 256})
	if err != nil {
		return nil, fmt.Errorf("sockhash: %w", err)
	}
	b.Cleanup(func() { _ = socks.Close() })
	peers, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 16, MaxEntries: 256})
	if err != nil {
		return nil, err
	}
	b.Cleanup(func() { _ = peers.Close() })
	const skPass = 1
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:       ebpf.SkSKB,
		AttachType: ebpf.AttachSkSKBStreamVerdict,
		License:    "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			asm.FnGetSocketCookie.Call(),
			asm.StoreMem(asm.RFP, -8, asm.R0, asm.DWord),
			asm.LoadMapPtr(asm.R1, peers.FD()),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -8),
			asm.FnMapLookupElem.Call(),
			asm.JNE.Imm(asm.R0, 0, "joined"),
			asm.Mov.Imm(asm.R0, skPass),
			asm.Return(),
			asm.Mov.Reg(asm.R7, asm.R0).WithSymbol("joined"),
			asm.LoadMem(asm.R1, asm.R6, 0, asm.Word), // __sk_buff.len
			asm.StoreXAdd(asm.R7, asm.R1, asm.DWord),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.LoadMapPtr(asm.R2, socks.FD()),
			asm.Mov.Reg(asm.R3, asm.R7),
			asm.Add.Imm(asm.R3, 8),
			asm.Mov.Imm(asm.R4, 0), // to the peer's send queue
			asm.FnSkRedirectHash.Call(),
			asm.Return(),
		},
	})
	if err != nil {
		return nil, err
	}
	b.Cleanup(func() { _ = prog.Close() })
	err = link.RawAttachProgram(link.RawAttachProgramOptions{Target: socks.FD(), Program: prog, Attach: ebpf.AttachSkSKBStreamVerdict})
	if err != nil {
		return nil, err
	}
	return &sockmapForwarder{socks: socks, peers: peers}, nil
}

// start listens and joins each connection with a new one to upstream.
func (f *sockmapForwarder) start(b *testing.B, upstream string) string {
	return serveLoopback(b, func(c net.Conn) { f.relay(c, upstream) })
}

// relay joins c with a new connection to upstream. It runs in its own
// goroutine, so a failure only ends the connection, and the download that
// used it fails its length check.
func (f *sockmapForwarder) relay(c net.Conn, upstream string) {
	defer c.Close()
	up, err := net.Dial("tcp", upstream)
	if err != nil {
		return
	}
	defer up.Close()
	request := make([]byte, 64<<10)
	n, err := c.Read(request)
	if err != nil {
		return
	}
	ends := []*net.TCPConn{c.(*net.TCPConn), up.(*net.TCPConn)}
	fds, cookies := make([]int, 2), make([]uint64, 2)
	for i, conn := range ends {
		if fds[i], cookies[i], err = socketOf(conn); err != nil {
			return
		}
	}
	for i := range ends {
		val := make([]byte, 16)
		binary.LittleEndian.PutUint64(val[8:], cookies[1-i])
		if f.peers.Put(cookies[i], val) != nil {
			return
		}
		defer f.peers.Delete(cookies[i]) //nolint:errcheck // gone with the socket either way
		if f.socks.Put(cookies[i], uint64(fds[i])) != nil {
			return
		}
	}
	if _, err := up.Write(request[:n]); err != nil {
		return
	}
	// Nothing reaches user space while joined: this read ends at the
	// client's close.
	var one [1]byte
	_, _ = c.Read(one[:])
}

// socketOf is conn's descriptor (valid while conn is open) and its cookie,
// the kernel's name for the socket that the verdict program looks up.
func socketOf(conn *net.TCPConn) (fd int, cookie uint64, err error) {
	rc, err := conn.SyscallConn()
	if err != nil {
		return 0, 0, err
	}
	if cerr := rc.Control(func(u uintptr) {
		fd = int(u)
		cookie, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	}); cerr != nil {
		return 0, 0, cerr
	}
	return fd, cookie, err
}
