package helm

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"agentplane.dev/pkg/testenv"
)

// The node profiles of the sandbox pod (docs/operations.md "Installing"), installed by the
// operator under the kubelet's seccomp root and loaded into AppArmor.
const (
	seccompProfileFile  = "../profiles/seccomp/agentplane-sandbox.json"
	apparmorProfileFile = "../profiles/apparmor/agentplane-sandbox"
)

// bubblewrapSyscalls are what the runtime's default profile refuses a process without
// CAP_SYS_ADMIN and bubblewrap needs to build a sandbox: clone with namespace flags (the
// default allows clone only without them), unshare (--unshare-cgroup-try, nested sandboxes),
// mount and umount2 (its new root, /proc, /dev, binds, read-only remounts), pivot_root, and
// sethostname (--hostname in its UTS namespace). Nothing else is added.
var bubblewrapSyscalls = []string{"clone", "mount", "pivot_root", "sethostname", "umount2", "unshare"}

// sandboxSeccompProfile is the OCI seccomp profile of the sandbox container: the container
// runtime's default profile (moby's, which containerd and CRI-O share) as it applies to a
// container without capabilities on x86_64 and arm64, plus bubblewrapSyscalls.
func sandboxSeccompProfile() specs.LinuxSeccomp {
	def := seccomp.DefaultProfile()
	out := specs.LinuxSeccomp{
		DefaultAction:   def.DefaultAction,
		DefaultErrnoRet: def.DefaultErrnoRet,
		Architectures:   []specs.Arch{specs.ArchX86_64, specs.ArchX86, specs.ArchX32, specs.ArchAARCH64, specs.ArchARM},
	}
	ours := []string{"amd64", "arm64", "x86", "x32", "arm"}
	anyOf := func(have []string) bool {
		return slices.ContainsFunc(have, func(a string) bool { return slices.Contains(ours, a) })
	}
	for _, s := range def.Syscalls {
		if s.Includes != nil && (len(s.Includes.Caps) > 0 || len(s.Includes.Arches) > 0 && !anyOf(s.Includes.Arches)) {
			continue // for a capability the container does not have, or another architecture
		}
		if s.Excludes != nil && slices.Contains(s.Excludes.Arches, "amd64") {
			continue
		}
		names := slices.DeleteFunc(slices.Clone(s.Names), func(n string) bool { return slices.Contains(bubblewrapSyscalls, n) })
		if len(names) == 0 {
			continue // clone only without namespace flags: replaced below
		}
		sc := s.LinuxSyscall
		sc.Names = names
		out.Syscalls = append(out.Syscalls, sc)
	}
	out.Syscalls = append(out.Syscalls, specs.LinuxSyscall{Names: bubblewrapSyscalls, Action: specs.ActAllow})
	return out
}

// TestSandboxSeccompProfile: the shipped Localhost profile is the runtime default plus exactly
// bubblewrapSyscalls (AGENTPLANE_UPDATE_PROFILES=1 rewrites it after a change here).
func TestSandboxSeccompProfile(t *testing.T) {
	want, err := json.MarshalIndent(sandboxSeccompProfile(), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	want = append(want, '\n')
	if os.Getenv("AGENTPLANE_UPDATE_PROFILES") == "1" {
		if err := os.MkdirAll(filepath.Dir(seccompProfileFile), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(seccompProfileFile, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(seccompProfileFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from the runtime default plus %v: run AGENTPLANE_UPDATE_PROFILES=1 go test -run TestSandboxSeccompProfile", seccompProfileFile, bubblewrapSyscalls)
	}
	var p specs.LinuxSeccomp
	if err := json.Unmarshal(got, &p); err != nil {
		t.Fatal(err)
	}
	// What the default refuses without CAP_SYS_ADMIN and bubblewrap does not need stays refused.
	for _, s := range p.Syscalls {
		for _, n := range s.Names {
			if slices.Contains([]string{"setns", "bpf", "perf_event_open", "open_tree", "move_mount", "fsopen", "syslog", "quotactl"}, n) && s.Action == specs.ActAllow {
				t.Errorf("%s allowed: bubblewrap does not need it", n)
			}
		}
	}
}

// TestSandboxAppArmorProfileParses compiles the shipped AppArmor profile with apparmor_parser
// (without loading it: the test machine's kernel may not run AppArmor).
func TestSandboxAppArmorProfileParses(t *testing.T) {
	parser, err := exec.LookPath("apparmor_parser")
	if err != nil {
		testenv.Missing(t, "apparmor_parser (Debian package apparmor)")
	}
	out, err := exec.Command(parser, "--skip-kernel-load", "--skip-cache", "--skip-read-cache", apparmorProfileFile).CombinedOutput()
	if err != nil {
		t.Fatalf("apparmor_parser: %v\n%s", err, out)
	}
	if b, _ := os.ReadFile(apparmorProfileFile); !strings.Contains(string(b), "\nprofile "+filepath.Base(apparmorProfileFile)+" ") {
		t.Fatalf("%s does not define profile %s", apparmorProfileFile, filepath.Base(apparmorProfileFile))
	}
}

// TestSandboxProfilesByDefault: the chart's defaults point the sandbox container at the shipped
// profiles (by the names docs/operations.md installs them under); Unconfined only when asked.
func TestSandboxProfilesByDefault(t *testing.T) {
	r, err := render(t, map[string]any{"redis": map[string]any{"url": "redis://r:6379/0"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range r.workloads() {
		if w.component != "sandbox" {
			continue
		}
		sc := w.pod.Spec.Containers[0].SecurityContext
		if sc.SeccompProfile == nil || sc.SeccompProfile.Type != "Localhost" || sc.SeccompProfile.LocalhostProfile == nil ||
			*sc.SeccompProfile.LocalhostProfile != "profiles/"+filepath.Base(seccompProfileFile) {
			t.Errorf("sandbox seccomp %+v, want Localhost profiles/%s", sc.SeccompProfile, filepath.Base(seccompProfileFile))
		}
		if sc.AppArmorProfile == nil || sc.AppArmorProfile.Type != "Localhost" || sc.AppArmorProfile.LocalhostProfile == nil ||
			*sc.AppArmorProfile.LocalhostProfile != filepath.Base(apparmorProfileFile) {
			t.Errorf("sandbox AppArmor %+v, want Localhost %s", sc.AppArmorProfile, filepath.Base(apparmorProfileFile))
		}
	}
	r, err = render(t, map[string]any{"redis": map[string]any{"url": "redis://r:6379/0"}, "sandbox": map[string]any{"namespaces": map[string]any{
		"seccompProfile": map[string]any{"type": "Unconfined"}}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range r.workloads() {
		if sc := w.pod.Spec.Containers[0].SecurityContext; w.component == "sandbox" && (sc.SeccompProfile.Type != "Unconfined" || sc.SeccompProfile.LocalhostProfile != nil) {
			t.Errorf("explicit Unconfined: %+v", sc.SeccompProfile)
		}
	}
}
