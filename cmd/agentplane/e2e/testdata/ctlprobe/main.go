// Command ctlprobe is a hostile peer of the control sockets (e2e
// TestTenantsCannotReachEachOther; a runtime in the agent's nested sandbox
// does not even see them, so the tests run it on the host): it dials each
// control socket in
// the directory named by its first argument and calls every
// SandboxService method, naming the sandbox and session of its other
// arguments with their tenant (a runtime can forge any field), then
// reflection, health and the wrapper's stream. It prints one line per call:
// "<method> <code> <reason>".
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
)

func main() {
	if len(os.Args) != 6 {
		fmt.Fprintln(os.Stderr, "usage: ctlprobe <control-dir> <sandbox> <session> <org> <user>")
		os.Exit(2)
	}
	ents, err := os.ReadDir(os.Args[1])
	if err != nil || len(ents) == 0 {
		fmt.Fprintln(os.Stderr, "no control socket:", err)
		os.Exit(1)
	}
	for _, e := range ents {
		probe(filepath.Join(os.Args[1], e.Name()), os.Args[2], os.Args[3], &sandboxv1.Tenant{OrgId: os.Args[4], UserId: os.Args[5]})
	}
}

func probe(sock, sb, ses string, tn *sandboxv1.Tenant) {
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println("dial", err)
		return
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := sandboxv1.NewSandboxServiceClient(conn)
	route := &sandboxv1.RouteSpec{SessionId: ses, SandboxId: sb, Directory: "/work/x", OrgId: tn.GetOrgId(), UserId: tn.GetUserId(),
		CredentialClass: sandboxv1.CredentialClass_CREDENTIAL_CLASS_STATIC}
	calls := []struct {
		name string
		call func() error
	}{
		{"Prepare", func() error { _, err := c.Prepare(ctx, &sandboxv1.PrepareRequest{Route: route}); return err }},
		{"Deliver", func() error {
			_, err := c.Deliver(ctx, &sandboxv1.DeliverRequest{SandboxId: sb, SessionId: ses, Tenant: tn,
				Messages: []*sandboxv1.DeliveryMessage{{MessageId: "evil", Content: "run: cat /etc/hostname"}}})
			return err
		}},
		{"Status", func() error {
			_, err := c.Status(ctx, &sandboxv1.StatusRequest{SandboxId: sb, SessionId: ses, Tenant: tn})
			return err
		}},
		{"Abort", func() error {
			_, err := c.Abort(ctx, &sandboxv1.AbortRequest{SandboxId: sb, SessionId: ses, Tenant: tn})
			return err
		}},
		{"GetScope", func() error {
			_, err := c.GetScope(ctx, &sandboxv1.GetScopeRequest{SandboxId: sb, Directory: "/work/x", Tenant: tn})
			return err
		}},
		{"CheckAgent", func() error { _, err := c.CheckAgent(ctx, &sandboxv1.CheckAgentRequest{}); return err }},
		{"WorktreeChanges", func() error {
			_, err := c.WorktreeChanges(ctx, &sandboxv1.WorktreeChangesRequest{SandboxId: sb, SessionId: ses, Tenant: tn})
			return err
		}},
		{"PushWorktree", func() error {
			_, err := c.PushWorktree(ctx, &sandboxv1.PushWorktreeRequest{SandboxId: sb, SessionId: ses, Tenant: tn, Branch: "evil", CommitMessage: "evil"})
			return err
		}},
		{"RotateHandle", func() error {
			_, err := c.RotateHandle(ctx, &sandboxv1.RotateHandleRequest{SandboxId: sb, SessionId: ses, Tenant: tn})
			return err
		}},
		{"UpdateEgressPolicy", func() error {
			_, err := c.UpdateEgressPolicy(ctx, &sandboxv1.UpdateEgressPolicyRequest{SandboxId: sb, SessionId: ses, Tenant: tn, Version: 1 << 40,
				Egress: &sandboxv1.EgressPolicy{Allow: []*sandboxv1.EgressRule{{Host: "evil.example", Ports: []uint32{443}}}}})
			return err
		}},
		{"ClaimSandbox", func() error {
			_, err := c.ClaimSandbox(ctx, &sandboxv1.ClaimSandboxRequest{SandboxId: sb, Tenant: tn})
			return err
		}},
		{"ReleaseRoute", func() error {
			_, err := c.ReleaseRoute(ctx, &sandboxv1.ReleaseRouteRequest{SandboxId: sb, SessionId: ses, Tenant: tn, Reason: "evil"})
			return err
		}},
		{"SuspendRoute", func() error {
			_, err := c.SuspendRoute(ctx, &sandboxv1.SuspendRouteRequest{SandboxId: sb, SessionId: ses, Tenant: tn})
			return err
		}},
		{"Reflection", func() error {
			s, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
			if err != nil {
				return err
			}
			// A refused stream may be over before the request is sent: Recv
			// says how it ended.
			_ = s.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}})
			_, err = s.Recv()
			return err
		}},
		{"Health", func() error {
			_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
			return err
		}},
		{"Connect", func() error {
			// A first frame that is not Hello: a served stream answers
			// HELLO_REQUIRED.
			s, err := sandboxv1.NewWrapperControlServiceClient(conn).Connect(ctx)
			if err != nil {
				return err
			}
			_ = s.Send(&sandboxv1.ConnectRequest{})
			_, err = s.Recv()
			return err
		}},
	}
	for _, cl := range calls {
		err := cl.call()
		st := status.Convert(err)
		reason := "-"
		for _, d := range st.Details() {
			if info, ok := d.(*errdetails.ErrorInfo); ok {
				reason = info.GetReason()
			}
		}
		fmt.Println(cl.name, st.Code(), reason)
	}
}
