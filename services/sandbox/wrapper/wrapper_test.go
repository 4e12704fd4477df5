package wrapper

import (
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// TestClaimDescriptorIsClosedOnExec: a pooled wrapper starts its runtime
// before its claim (and the launch credential in it) arrives; the claim
// descriptor it inherited is marked close-on-exec before anything starts,
// so no runtime it execs holds it, whatever descriptors that runtime gets.
func TestClaimDescriptorIsClosedOnExec(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	defer r.Close()
	fd := int(r.Fd())
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, 0); err != nil { // as inherited: no FD_CLOEXEC
		t.Fatal(err)
	}
	t.Setenv(provider.EnvSandbox, ".pool-test")
	t.Setenv(provider.EnvRuntimeKey, "pool")
	t.Setenv(provider.EnvInstance, "ptest")
	o, err := parse([]string{"--control-addr", "127.0.0.1:1", "--claim-fd", strconv.Itoa(fd)})
	if err != nil {
		t.Fatal(err)
	}
	if o.Claim == nil || o.Credential != "" {
		t.Fatalf("a pooled wrapper has a claim and no credential yet: %+v", o)
	}
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	if err != nil {
		t.Fatal(err)
	}
	if flags&unix.FD_CLOEXEC == 0 {
		t.Fatal("the claim descriptor would be inherited by the runtime")
	}
	if _, err := parse([]string{"--control-addr", "127.0.0.1:1", "--claim-fd", strconv.Itoa(fd), "--allocation", "a"}); err == nil {
		t.Fatal("--claim-fd with --allocation accepted")
	}
}
