package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

var (
	ctlprobeOnce sync.Once
	ctlprobeBin  string
	ctlprobeErr  error
)

// ctlprobe builds testdata/ctlprobe (a hostile peer's gRPC client of the
// control sockets) into a directory of its own.
func ctlprobe(t *testing.T) string {
	ctlprobeOnce.Do(func() {
		dir := filepath.Join(filepath.Dir(wrapperBin), "probe")
		if ctlprobeErr = os.MkdirAll(dir, 0o755); ctlprobeErr != nil {
			return
		}
		ctlprobeBin = filepath.Join(dir, "ctlprobe")
		cmd := exec.Command("go", "build", "-o", ctlprobeBin, "./testdata/ctlprobe")
		cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0") // runs inside the boundary
		if out, err := cmd.CombinedOutput(); err != nil {
			ctlprobeErr = fmt.Errorf("build ctlprobe: %w: %s", err, out)
		}
	})
	require.NoError(t, ctlprobeErr)
	return ctlprobeBin
}

// tenantSuite is a suite (the internal token off with noToken) and ctlprobe.
func tenantSuite(t *testing.T, noToken bool) (*suite, string) {
	probe := ctlprobe(t)
	return startSuiteTuned(t, stackOptions{noToken: noToken}, nil, nil), probe
}

// createAs creates a session of tenant tn in sandbox sb; it returns the
// session or CreateSession's error.
func createAs(s *suite, tn *sandboxv1.Tenant, sb, dir string) (*sessionv1.Session, error) {
	return createAgentAs(s, tn, sb, dir, newSecret(), "")
}

// createAgentAs is createAs with the backing secret and the agent profile
// ("": the default runtime).
func createAgentAs(s *suite, tn *sandboxv1.Tenant, sb, dir, secret, profile string) (*sessionv1.Session, error) {
	req := &sessionv1.CreateSessionRequest{
		UserId: tn.GetUserId(), OrgId: tn.GetOrgId(), SandboxId: sb, Worktree: &sessionv1.Worktree{Directory: dir},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: secret},
	}
	if profile != "" {
		req.Agent = &sessionv1.Agent{Profile: profile}
	}
	resp, err := s.ses.CreateSession(context.Background(), req)
	return resp.GetSession(), err
}

// runIn runs argv in the session's runtime ("run:": the scripted runtime's
// run_command, or an agent's shell tool called by the fake model) and
// returns its output.
func runIn(t testing.TB, s *suite, sessionID, messageID string, argv ...string) string {
	t.Helper()
	events := s.turn(t, sessionID, messageID, "run: "+strings.Join(argv, " "))
	var seen []string
	for _, re := range runtimeEvents(events, messageID)[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT] {
		switch re.GetToolName() {
		case "run_command":
			return re.GetData().GetFields()["output"].GetStringValue()
		case fakemodel.ShellTool: // the ACP tool_call_update's content: the command's output
			return re.GetText()
		}
		seen = append(seen, re.GetToolName())
	}
	t.Fatalf("no run_command or %s result for %s (tool results: %v)", fakemodel.ShellTool, messageID, seen)
	return ""
}

// requireControlSocketServesOnlyTheWrapper: the session's runtime, in the
// agent's nested sandbox, finds no control socket at all (its /run is
// covered: decision 57); a hostile peer that does reach one — ctlprobe run
// on the host against every control socket of the sandbox root, naming
// victim's sandbox and session with victim's tenant — gets every
// SandboxService method and reflection refused, and only health and the
// wrapper's stream answer.
func requireControlSocketServesOnlyTheWrapper(t *testing.T, s *suite, probe, sessionID string, victim *sessionv1.Session) {
	t.Helper()
	out := runIn(t, s, sessionID, "probe", "ls", "/run/agentplane/control")
	require.Contains(t, out, "No such file or directory", "the runtime sees no control socket: %s", out)
	cmd := exec.Command(probe, filepath.Join(s.root, ".sockets", "control"), victim.GetSandboxId(), victim.GetSessionId(),
		victim.GetOrgId(), victim.GetUserId())
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", b)
	t.Logf("ctlprobe on the control sockets:\n%s", b)
	got := map[string]string{}
	for line := range strings.Lines(strings.TrimSpace(string(b))) {
		f := strings.Fields(line)
		require.Len(t, f, 3, "line %q", line)
		require.NotContains(t, got, f[0], "one control socket per replica: one answer")
		got[f[0]] = f[1] + " " + f[2]
	}
	for _, m := range []string{"Prepare", "Deliver", "Status", "Abort", "GetScope", "CheckAgent", "WorktreeChanges",
		"PushWorktree", "RotateHandle", "UpdateEgressPolicy", "ClaimSandbox", "ReleaseRoute", "SuspendRoute", "Reflection"} {
		require.Equal(t, "PermissionDenied METHOD_NOT_SERVED", got[m], m)
	}
	require.Equal(t, "OK -", got["Health"])
	require.Equal(t, "InvalidArgument HELLO_REQUIRED", got["Connect"], "the wrapper's stream is served (and wants its Hello)")
	require.Len(t, got, 16)
}

// defaultSandbox is session.SandboxFor: anyone can compute a tenant's
// default sandbox id.
func defaultSandbox(org, user string) string {
	sum := sha256.Sum256([]byte(org + "\x00" + user))
	return "sbx-" + hex.EncodeToString(sum[:8])
}

// requireJoinRefused: mallory's CreateSession naming alice's sandbox, or
// alice's default sandbox, is refused PERMISSION_DENIED
// SANDBOX_TENANT_MISMATCH; her direct SandboxService calls (with the
// internal token) naming alice's sandbox are refused exactly as for a
// sandbox nobody named, and so are Prepare and ClaimSandbox as mallory.
func requireJoinRefused(t *testing.T, s *suite, alice, mallory *sandboxv1.Tenant, a *sessionv1.Session) {
	t.Helper()
	// The join: alice's sandbox, and alice's default sandbox.
	for _, sb := range []string{a.GetSandboxId(), defaultSandbox(alice.GetOrgId(), alice.GetUserId())} {
		_, err := createAs(s, mallory, sb, "/work/alice")
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%s: %v", sb, err)
		require.Equal(t, "SANDBOX_TENANT_MISMATCH", apierr.Reason(err))
	}

	// Direct calls with the internal token, as mallory, on alice's sandbox
	// and on one nobody named: the same refusal.
	call := func(sb string) map[string]error {
		ctx, c := context.Background(), s.sbx
		out := map[string]error{}
		_, out["Deliver"] = c.Deliver(ctx, &sandboxv1.DeliverRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId(),
			Messages: []*sandboxv1.DeliveryMessage{{MessageId: "evil", Content: "run: cat secret.txt"}}})
		_, out["Status"] = c.Status(ctx, &sandboxv1.StatusRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId()})
		_, out["Abort"] = c.Abort(ctx, &sandboxv1.AbortRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId()})
		_, out["GetScope"] = c.GetScope(ctx, &sandboxv1.GetScopeRequest{Tenant: mallory, SandboxId: sb, Directory: "/work/alice"})
		_, out["WorktreeChanges"] = c.WorktreeChanges(ctx, &sandboxv1.WorktreeChangesRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId()})
		_, out["PushWorktree"] = c.PushWorktree(ctx, &sandboxv1.PushWorktreeRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId(),
			Branch: "evil", CommitMessage: "evil"})
		_, out["RotateHandle"] = c.RotateHandle(ctx, &sandboxv1.RotateHandleRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId()})
		_, out["UpdateEgressPolicy"] = c.UpdateEgressPolicy(ctx, &sandboxv1.UpdateEgressPolicyRequest{Tenant: mallory, SandboxId: sb,
			SessionId: a.GetSessionId(), Version: 1 << 40, Egress: &sandboxv1.EgressPolicy{Allow: []*sandboxv1.EgressRule{{Host: "evil.example", Ports: []uint32{443}}}}})
		_, out["ReleaseRoute"] = c.ReleaseRoute(ctx, &sandboxv1.ReleaseRouteRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId(),
			Reason: "session-delete"})
		_, out["SuspendRoute"] = c.SuspendRoute(ctx, &sandboxv1.SuspendRouteRequest{Tenant: mallory, SandboxId: sb, SessionId: a.GetSessionId()})
		return out
	}
	onAlice, onNone := call(a.GetSandboxId()), call("sbx-nobody-"+s.run)
	for m, err := range onAlice {
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%s: %v", m, err)
		require.Equal(t, "SANDBOX_TENANT_MISMATCH", apierr.Reason(err), m)
		require.True(t, proto.Equal(status.Convert(err).Proto(), status.Convert(onNone[m]).Proto()), "%s: %v, nobody's: %v", m, err, onNone[m])
	}
	r := &sandboxv1.PrepareRequest{Route: &sandboxv1.RouteSpec{SessionId: "evil", SandboxId: a.GetSandboxId(), Directory: "/work/alice",
		OrgId: mallory.GetOrgId(), UserId: mallory.GetUserId(), CredentialClass: sandboxv1.CredentialClass_CREDENTIAL_CLASS_STATIC}}
	_, err := s.sbx.Prepare(context.Background(), r)
	require.Equal(t, "SANDBOX_TENANT_MISMATCH", apierr.Reason(err), "%v", err)
	_, err = s.sbx.ClaimSandbox(context.Background(), &sandboxv1.ClaimSandboxRequest{SandboxId: a.GetSandboxId(), Tenant: mallory})
	require.Equal(t, "SANDBOX_TENANT_MISMATCH", apierr.Reason(err), "%v", err)
}

// TestTenantsCannotReachEachOther (issue 31 items 1 and 5): two tenants
// of different orgs on one suite with the internal token on. Mallory's
// CreateSession naming alice's sandbox, or alice's default sandbox, is
// refused; her direct SandboxService calls naming alice's sandbox are
// refused exactly as for a sandbox nobody named; her runtime, calling the
// SandboxService through the control socket in its sandbox as alice,
// reaches nothing but the wrapper's stream and health. Alice's work goes on.
func TestTenantsCannotReachEachOther(t *testing.T) {
	s, probe := tenantSuite(t, false)
	alice := &sandboxv1.Tenant{OrgId: "orgA-" + s.run, UserId: "alice"}
	mallory := &sandboxv1.Tenant{OrgId: "orgEvil-" + s.run, UserId: "mallory"}
	var a *sessionv1.Session
	require.Eventually(t, func() bool {
		var err error
		a, err = createAs(s, alice, "sbx-alice-"+s.run, "/work/alice")
		return err == nil
	}, 30e9, 50e6, "the services come up")
	s.turn(t, a.GetSessionId(), "a1", "write: secret.txt alice-secret")

	requireJoinRefused(t, s, alice, mallory, a)

	// Mallory's own runtime looks for the control socket; a peer that has one calls it as alice.
	m, err := createAs(s, mallory, "sbx-mallory-"+s.run, "/work/mallory")
	require.NoError(t, err)
	requireControlSocketServesOnlyTheWrapper(t, s, probe, m.GetSessionId(), a)

	// Alice's session is untouched: her file, her next turn.
	out := runIn(t, s, a.GetSessionId(), "a2", "cat", "secret.txt")
	require.Contains(t, out, "alice-secret")
}

// TestControlSocketServesOnlyTheWrapperWithoutToken: a deployment with no
// internal token. A runtime calling the SandboxService through
// its control socket, as another session, is refused.
func TestControlSocketServesOnlyTheWrapperWithoutToken(t *testing.T) {
	s, probe := tenantSuite(t, true)
	other := s.create(t, "sbx-ctl-victim", "/work/victim", newSecret())
	s.turn(t, other.GetSessionId(), "v1", "hello")
	own := s.create(t, "sbx-ctl-hostile", "/work/hostile", newSecret())
	requireControlSocketServesOnlyTheWrapper(t, s, probe, own.GetSessionId(), other)
	s.turn(t, other.GetSessionId(), "v2", "hello again")
}
