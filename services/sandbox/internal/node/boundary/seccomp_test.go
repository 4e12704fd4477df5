package boundary

import (
	"encoding/json"
	"os"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// With BOUNDARY_SECCOMP_HELPER set the test binary runs seccompProbes
// inside the boundary and prints each one's errno (before TestMain, so
// this file needs no hook in it).
func init() {
	if os.Getenv("BOUNDARY_SECCOMP_HELPER") != "" {
		got := map[string]string{}
		for _, p := range seccompProbes {
			got[p.name] = errno(p.try())
		}
		_ = json.NewEncoder(os.Stdout).Encode(got)
		os.Exit(0)
	}
}

type seccompProbe struct {
	name    string
	refused bool // want EPERM; otherwise anything the filter did not answer
	try     func() error
}

func raw(nr uintptr, a ...uintptr) error {
	var args [6]uintptr
	copy(args[:], a)
	r, _, e := unix.Syscall6(nr, args[0], args[1], args[2], args[3], args[4], args[5])
	if e != 0 {
		return e
	}
	if nr == unix.SYS_SOCKET || nr == unix.SYS_IO_URING_SETUP || nr == unix.SYS_MEMFD_SECRET {
		_ = unix.Close(int(r)) // a descriptor the probe opened
	}
	return nil
}

func sock(domain, typ, proto int) func() error {
	return func() error { return raw(unix.SYS_SOCKET, uintptr(domain), uintptr(typ), uintptr(proto)) }
}

// seccompProbes are each refused system call and socket family, and the
// controls next to them that must keep working.
var seccompProbes = []seccompProbe{
	{"io_uring_setup", true, func() error {
		var params [120]byte // struct io_uring_params, zeroed
		return raw(unix.SYS_IO_URING_SETUP, 1, uintptr(unsafe.Pointer(&params[0])))
	}},
	{"io_uring_enter", true, func() error { return raw(unix.SYS_IO_URING_ENTER, ^uintptr(0), 0, 0, 0, 0, 0) }},
	{"io_uring_register", true, func() error { return raw(unix.SYS_IO_URING_REGISTER, ^uintptr(0), 0, 0, 0) }},
	{"memfd_secret", true, func() error { return raw(unix.SYS_MEMFD_SECRET, 0) }},
	{"kcmp", true, func() error {
		pid := uintptr(os.Getpid())
		return raw(unix.SYS_KCMP, pid, pid, 0 /* KCMP_FILE */, 0, 0)
	}},
	{"move_pages", true, func() error { return raw(unix.SYS_MOVE_PAGES, 0, 0, 0, 0, 0, 0) }},
	{"migrate_pages", true, func() error { return raw(unix.SYS_MIGRATE_PAGES, 0, 0, 0, 0) }},
	{"fanotify_init", true, func() error { return raw(unix.SYS_FANOTIFY_INIT, 0, 0) }},
	{"personality_read_implies_exec", true, func() error { return raw(unix.SYS_PERSONALITY, readImpliesExec) }},
	{"personality_addr_no_randomize", true, func() error { return raw(unix.SYS_PERSONALITY, addrNoRandomize) }},
	// The kernel reads a 32-bit persona: high bits must not smuggle one in.
	{"personality_high_bits", true, func() error { return raw(unix.SYS_PERSONALITY, 1<<32|readImpliesExec) }},
	{"personality_query", false, func() error { return raw(unix.SYS_PERSONALITY, 0xffffffff) }},
	{"personality_default", false, func() error { return raw(unix.SYS_PERSONALITY, 0) }},

	{"socket_vsock", true, sock(unix.AF_VSOCK, unix.SOCK_STREAM, 0)},
	{"socket_vsock_high_bits", true, func() error { return raw(unix.SYS_SOCKET, 1<<32|unix.AF_VSOCK, unix.SOCK_STREAM, 0) }},
	{"socket_netlink_audit", true, sock(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_AUDIT)},
	{"socket_netlink_netfilter", true, sock(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_NETFILTER)},
	{"socket_netlink_uevent", true, sock(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_KOBJECT_UEVENT)},
	{"socket_netlink_generic", true, sock(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_GENERIC)},
	{"socket_netlink_route_high_bits", true, func() error {
		return raw(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, 1<<32|unix.NETLINK_ROUTE)
	}},
	{"socket_packet", true, sock(unix.AF_PACKET, unix.SOCK_RAW, 0)},
	{"socket_alg", true, sock(unix.AF_ALG, unix.SOCK_SEQPACKET, 0)},
	{"socket_key", true, sock(unix.AF_KEY, unix.SOCK_RAW, 2 /* PF_KEY_V2 */)},
	{"socket_bluetooth", true, sock(unix.AF_BLUETOOTH, unix.SOCK_RAW, 0)},
	{"socket_tipc", true, sock(unix.AF_TIPC, unix.SOCK_RDM, 0)},
	{"socket_rds", true, sock(unix.AF_RDS, unix.SOCK_SEQPACKET, 0)},
	{"socket_xdp", true, sock(unix.AF_XDP, unix.SOCK_RAW, 0)},
	{"socketpair_tipc", true, func() error { _, err := unix.Socketpair(unix.AF_TIPC, unix.SOCK_STREAM, 0); return err }},

	{"socket_inet", false, sock(unix.AF_INET, unix.SOCK_STREAM, 0)},
	{"socket_inet6", false, sock(unix.AF_INET6, unix.SOCK_DGRAM, 0)},
	{"socket_unix", false, sock(unix.AF_UNIX, unix.SOCK_STREAM, 0)},
	{"socket_netlink_route", false, sock(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE)},
	{"socketpair_unix", false, func() error {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
		if err == nil {
			_, _ = unix.Close(fds[0]), unix.Close(fds[1])
		}
		return err
	}},
}

// TestSeccompRefusesFromInside runs every probe in a real sandbox: each
// refused system call and socket family answers EPERM, each control does
// not (it may still fail for its own reason, never with the filter's EPERM
// where the kernel would not give one).
func TestSeccompRefusesFromInside(t *testing.T) {
	got := runSelfInSandbox(t, "BOUNDARY_SECCOMP_HELPER")
	for _, p := range seccompProbes {
		t.Run(p.name, func(t *testing.T) {
			if p.refused {
				require.Equal(t, "EPERM", got[p.name])
				return
			}
			require.Equal(t, "ok", got[p.name])
		})
	}
}

const (
	readImpliesExec = 0x0400000 // <linux/personality.h>
	addrNoRandomize = 0x0040000
)
