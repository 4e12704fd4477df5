package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"
	"agentplane.dev/pkg/config"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/pkg/testaddr"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
)

// The services `agentplane dev` must expose, by offset from --port-base
// (docs/development.md: 7401 + offset).
var devServices = map[int][]string{
	0: {"agentplane.session.v1.SessionService"},
	1: {"agentplane.sandbox.v1.SandboxService", "agentplane.sandbox.v1.WrapperControlService"},
	2: {"agentplane.credential.v1.CredentialService"},
	3: {"agentplane.ingest.v1.IngestService"},
}

// freePortBase finds a base whose five service ports and four metrics
// ports are free and reserved (testaddr) until the test ends, so the test
// runs beside a developer's own `agentplane dev` on the documented ports and
// beside other test processes.
func freePortBase(t *testing.T) int {
	t.Helper()
	offsets := []int{0, 1, 2, 3, 4, 5, 6, 2000, 2001, 2002, 2003}
	from, to := testaddr.Span()
	for {
		base := from + rand.IntN(to-from-offsets[len(offsets)-1])
		var held []func()
		for _, off := range offsets {
			release, ok := testaddr.TryReserve(base + off)
			if !ok {
				break
			}
			held = append(held, release)
		}
		if len(held) == len(offsets) {
			t.Cleanup(func() {
				for _, release := range held {
					release()
				}
			})
			return base
		}
		for _, release := range held {
			release()
		}
	}
}

// TestDevStartsAllServicesAndStopsCleanly runs `agentplane dev` as a real
// process: every service of all four is listed through gRPC reflection and
// SERVING on health; after SIGTERM the process exits 0 within its drain bound
// and the private redis-server it started is gone.
func TestDevStartsAllServicesAndStopsCleanly(t *testing.T) {
	bin := buildAgentplane(t)

	const drain, graceful = 200 * time.Millisecond, 3 * time.Second
	root := t.TempDir()
	// The sandbox user may reach the root (as under dev's own scratch
	// directory), not the binary's directory (private, as `go run`'s).
	require.NoError(t, os.Chmod(filepath.Dir(root), 0o711))
	require.NoError(t, os.Chmod(root, 0o755))
	require.NoError(t, os.Chmod(filepath.Dir(bin), 0o700))
	base := freePortBase(t)
	// The metrics ports are moved away from base+2000 (a free range found
	// the same way, whose service ports go unused).
	metricsBase := freePortBase(t)
	addr := func(off int) string { return fmt.Sprintf("127.0.0.1:%d", base+off) }
	cmd := exec.Command(bin, "dev", "--drain-delay", drain.String(), "--shutdown-timeout", graceful.String(),
		"--sandbox-root", root, "--port-base", strconv.Itoa(base), "--metrics-port-base", strconv.Itoa(metricsBase))
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var logs logtest.Buffer
	cmd.Stderr = io.MultiWriter(t.Output(), &logs)
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	// The banner names the private redis-server's URL.
	redisURL := make(chan string, 1)
	metricsURLs := make(chan string, 4)
	var banner logtest.Buffer
	go func() {
		sc := bufio.NewScanner(stdout)
		re := regexp.MustCompile(`private redis-server at (redis://\S+)`)
		metricsRe := regexp.MustCompile(`http://127\.0\.0\.1:\d+/metrics`)
		for sc.Scan() {
			t.Log(sc.Text())
			_, _ = fmt.Fprintln(&banner, sc.Text())
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				redisURL <- m[1]
			}
			if m := metricsRe.FindString(sc.Text()); m != "" {
				metricsURLs <- m
			}
		}
	}()
	var url string
	select {
	case url = <-redisURL:
	case err := <-exited:
		t.Fatalf("agentplane dev exited early: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("agentplane dev printed no banner")
	}
	redisPort := url[strings.LastIndex(url, ":")+1:]
	require.NotEmpty(t, redisServers(t, redisPort), "the private redis-server runs while dev runs")

	for off, want := range devServices {
		conn := devConn(t, addr(off), addr(0))
		waitServing(t, conn, addr(off))
		listed := listServices(t, conn)
		require.Subset(t, listed, want, "services listed by reflection on %s", addr(off))
		// The services' calls to each other are served, not listed: no person calls them.
		require.NotContains(t, listed, "agentplane.session.v1.SessionNotifyService")
		require.NoError(t, conn.Close())
	}
	// dev has an internal token of its own: without it the services' calls
	// to each other (and every other call) are refused.
	bare, err := grpc.NewClient(addr(0), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	_, err = sessionv1.NewSessionNotifyServiceClient(bare).NotifyRouteReady(context.Background(), &sessionv1.NotifyRouteReadyRequest{})
	require.Equal(t, codes.Unauthenticated, status.Code(err), "a notification without dev's token: %v", err)
	_, err = sessionv1.NewSessionServiceClient(bare).ListSessions(context.Background(), &sessionv1.ListSessionsRequest{})
	require.Equal(t, codes.Unauthenticated, status.Code(err), "a call without dev's token: %v", err)
	require.NoError(t, bare.Close())
	// The start-up table names the four metrics addresses, on the moved base, and each serves.
	for i := range 4 {
		var u string
		select {
		case u = <-metricsURLs:
		case <-time.After(10 * time.Second):
			t.Fatalf("the start-up table named %d metrics addresses, want 4", i)
		}
		require.Contains(t, u, fmt.Sprintf(":%d/", metricsBase+i), "metrics address %d", i)
		resp, err := http.Get(u)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, u)
		require.Contains(t, string(body), "grpc_server_handled_total", u)
	}

	// The start-up table says how sandboxes are isolated; with bubblewrap
	// here (always under CI=true) that is the namespaces boundary.
	require.Eventually(t, func() bool { return strings.Contains(banner.String(), "isolation: ") }, 10*time.Second, 10*time.Millisecond)
	if _, err := exec.LookPath("bwrap"); err == nil || os.Getenv("CI") == "true" {
		require.Contains(t, banner.String(), "isolation: namespaces (bubblewrap)")
		if os.Geteuid() == 0 {
			// The test binary's build directory is private: dev starts a
			// copy, so sandboxes still run as the unprivileged user.
			require.NotContains(t, banner.String(), "sandboxes as this process's uid")
		}
	}

	// A session with a message leaves a wrapper and a runtime running
	// under the sandbox root.
	conn := devConn(t, addr(0), addr(0))
	defer conn.Close()
	sessions := sessionv1.NewSessionServiceClient(conn)
	created, err := sessions.CreateSession(t.Context(), &sessionv1.CreateSessionRequest{
		UserId: "u1", OrgId: "o1", Worktree: &sessionv1.Worktree{Directory: "/work/dev-test"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-dev-test"},
	})
	require.NoError(t, err)
	_, err = sessions.SendMessage(t.Context(), &sessionv1.SendMessageRequest{
		SessionId: created.GetSession().GetSessionId(), MessageId: "m1", Content: "hello",
	})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(sandboxprocs.Under(root)) > 0 },
		60*time.Second, 100*time.Millisecond, "a wrapper runs under the sandbox root")

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	// Bound: drain delay plus every service's graceful stop (they stop in
	// parallel), plus generous slack for a loaded CI machine.
	select {
	case err := <-exited:
		require.NoError(t, err, "agentplane dev exits 0 after SIGTERM")
	case <-time.After(drain + graceful + 10*time.Second + 20*time.Second): // + dev's wrapper stop bound
		t.Fatal("agentplane dev did not exit within its drain bound")
	}
	require.Empty(t, redisServers(t, redisPort), "no redis-server started by dev is left running")
	require.Empty(t, sandboxprocs.Under(root), "no wrapper or runtime started by dev is left running")
	// The sandbox stopped while the session service still answered.
	require.Zero(t, strings.Count(logs.String(), "not sent at shutdown"), "notifications left unsent (log above)")
}

// buildAgentplane builds this binary into a temporary directory, with
// agentplane-wrapper next to it (where dev finds the wrapper, as the
// image has it).
func buildAgentplane(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, buildBinaries(dir), "build agentplane")
	return filepath.Join(dir, "agentplane")
}

// buildBinaries builds agentplane and agentplane-wrapper into dir.
func buildBinaries(dir string) error {
	for _, b := range []struct{ out, pkg string }{
		{"agentplane", "."},
		{"agentplane-wrapper", "agentplane.dev/services/sandbox/cmd/agentplane-wrapper"},
	} {
		build := exec.Command("go", "build", "-o", filepath.Join(dir, b.out), b.pkg)
		build.Stderr = os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("build %s: %w", b.out, err)
		}
	}
	return nil
}

func waitServing(t *testing.T, conn *grpc.ClientConn, addr string) {
	t.Helper()
	hc := healthpb.NewHealthClient(conn)
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: ""})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}, 60*time.Second, 100*time.Millisecond, "%s never became SERVING", addr)
}

func listServices(t *testing.T, conn *grpc.ClientConn) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{ListServices: "*"},
	}))
	resp, err := stream.Recv()
	require.NoError(t, err)
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	return names
}

// redisServers returns the pids of live redis-server processes listening on
// port, read from /proc (not from dev's own account of what it started).
func redisServers(t *testing.T, port string) []string {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var pids []string
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue // not a process, or gone
		}
		args := strings.Split(string(cmdline), "\x00")
		if !strings.Contains(args[0], "redis-server") || !strings.Contains(string(cmdline), port) {
			continue
		}
		if stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && strings.Contains(string(stat), ") Z ") {
			continue // zombie: exited, not yet reaped by its parent
		}
		pids = append(pids, e.Name())
	}
	return pids
}

func TestDevMetricsPortBase(t *testing.T) {
	o := devOptions{portBase: 7401, metricsPortBase: -1}
	require.NoError(t, o.checkPorts())
	require.Equal(t, 9401, o.metricsPortBase, "default: port base + 2000")
	require.Equal(t, 7406, o.redisPort, "the private Redis: port base + 5")

	var ses, sbx, cred, ing config.Common
	var proxy string
	devPorts(7401, 30000, &ses, &sbx, &cred, &ing, &proxy)
	require.Equal(t, []string{"127.0.0.1:30000", "127.0.0.1:30001", "127.0.0.1:30002", "127.0.0.1:30003"},
		[]string{ses.MetricsAddr, sbx.MetricsAddr, cred.MetricsAddr, ing.MetricsAddr})
	require.Equal(t, "http://127.0.0.1:30000/metrics", metricsColumn(ses.MetricsAddr))

	devPorts(7401, 0, &ses, &sbx, &cred, &ing, &proxy)
	require.Empty(t, ses.MetricsAddr+sbx.MetricsAddr+cred.MetricsAddr+ing.MetricsAddr, "0: no metrics listeners")
	require.Equal(t, "off", metricsColumn(ses.MetricsAddr))

	for _, bad := range []devOptions{
		{portBase: 7401, metricsPortBase: 65534},
		{portBase: 7401, metricsPortBase: -5},
		{portBase: 7401, metricsPortBase: 7399}, // overlaps 7401..7407
		{portBase: 7401, metricsPortBase: 7405}, // overlaps the Redis and fake model ports
		{portBase: 7401, metricsPortBase: -1, redisPort: 70000},
		{portBase: 0, metricsPortBase: -1},
	} {
		require.Error(t, bad.checkPorts(), "%+v", bad)
	}
}
