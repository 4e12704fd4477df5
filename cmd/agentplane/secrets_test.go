package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/pkg/redistest"
)

// procReadEnv makes the test binary a /proc reader (see TestMain): it tries to read the
// environment and the memory of the process whose pid the variable holds and prints what it got.
const procReadEnv = "AGENTPLANE_TEST_PROC_READ"

// procRead is what a reader child got from /proc/<pid>.
type procRead struct {
	Environ    string `json:"environ"`
	EnvironErr string `json:"environ_err"`
	Mem        []byte `json:"mem"`
	MemErr     string `json:"mem_err"`
}

func TestMain(m *testing.M) {
	if pid := os.Getenv(procReadEnv); pid != "" {
		_ = json.NewEncoder(os.Stdout).Encode(readProc(pid))
		os.Exit(0)
	}
	code := m.Run()
	if versionBuild.bin != "" {
		_ = os.RemoveAll(filepath.Dir(versionBuild.bin))
	}
	os.Exit(code)
}

// readProc reads /proc/<pid>/environ and some bytes of the first readable mapping of
// /proc/<pid>/mem, as any local process of the same uid could try.
func readProc(pid string) procRead {
	var r procRead
	env, err := os.ReadFile("/proc/" + pid + "/environ")
	r.Environ = string(env)
	if err != nil {
		r.EnvironErr = err.Error()
	}
	mem, err := os.Open("/proc/" + pid + "/mem")
	if err != nil {
		r.MemErr = err.Error()
		return r
	}
	defer mem.Close()
	maps, err := os.ReadFile("/proc/" + pid + "/maps")
	if err != nil {
		r.MemErr = err.Error()
		return r
	}
	for _, line := range strings.Split(string(maps), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || !strings.HasPrefix(f[1], "r") {
			continue
		}
		start, err := strconv.ParseUint(strings.Split(f[0], "-")[0], 16, 64)
		if err != nil {
			continue
		}
		buf := make([]byte, 64)
		n, err := mem.ReadAt(buf, int64(start))
		if n > 0 {
			r.Mem = buf[:n]
			return r
		}
		r.MemErr = fmt.Sprint(err)
	}
	return r
}

// sameUID is the uid both the service and the would-be reader run as: the test's own, or
// nobody when the test runs as root (root has CAP_SYS_PTRACE, which reads anything).
func sameUID() *syscall.SysProcAttr {
	if os.Geteuid() != 0 {
		return nil
	}
	return &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534, NoSetGroups: true}}
}

// sharedDir is a directory the reader uid can traverse, holding the binaries and the secret files.
func sharedDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "agentplane-secrets-test-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	return dir
}

// writeSecret writes a secret file that only the service's uid can read.
func writeSecret(t *testing.T, dir, name, value string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(value+"\n"), 0o600))
	if a := sameUID(); a != nil {
		require.NoError(t, os.Chown(p, int(a.Credential.Uid), int(a.Credential.Gid)))
	}
	return p
}

func randomSecret(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return base64.StdEncoding.EncodeToString(b)
}

// readAs runs the test binary as a /proc reader of pid with the given uid.
func readAs(t *testing.T, reader string, attr *syscall.SysProcAttr, pid int) procRead {
	t.Helper()
	cmd := exec.Command(reader, "-test.run=^$")
	cmd.Env = []string{procReadEnv + "=" + strconv.Itoa(pid)}
	cmd.SysProcAttr = attr
	out, err := cmd.Output()
	require.NoError(t, err, "reader: %s", out)
	var r procRead
	require.NoError(t, json.Unmarshal(out, &r), "%s", out)
	return r
}

// syncBuffer collects a child's output while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestSecretsOutOfReach (issue 16 item 7) runs the real `agentplane credential` as an
// unprivileged uid with its secrets in files (the Redis password, the internal token, the
// credential key) and one in the environment (the attestation key: the compatibility form).
// The service uses each of them (Redis requires the password, calls require the token), yet a
// process of the same uid reads neither its environment nor its memory, while the same reader
// does read those of a dumpable process of that uid; and no secret appears in its logs.
func TestSecretsOutOfReach(t *testing.T) {
	dir := sharedDir(t)
	bin := filepath.Join(dir, "agentplane")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run(), "build agentplane")
	self, err := os.Executable()
	require.NoError(t, err)
	reader := filepath.Join(dir, "reader")
	selfBin, err := os.ReadFile(self)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(reader, selfBin, 0o755))

	redisPassword := hex.EncodeToString([]byte(randomSecret(t, 12)))
	token := "tok-" + randomSecret(t, 24)
	credKey := randomSecret(t, 32)
	attKey := randomSecret(t, 32)
	srv := redistest.Start(t)
	require.NoError(t, srv.Client(t).ConfigSet(t.Context(), "requirepass", redisPassword).Err())

	marker := "marker-" + randomSecret(t, 8)
	cmd := exec.Command(bin, "credential")
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"),
		"AGENTPLANE_TEST_MARKER=" + marker,
		"AGENTPLANE_REDIS_URL=" + srv.URL(),
		"AGENTPLANE_REDIS_PASSWORD_FILE=" + writeSecret(t, dir, "redis-password", redisPassword),
		"AGENTPLANE_INTERNAL_TOKEN_FILE=" + writeSecret(t, dir, "internal-token", token),
		"AGENTPLANE_CREDENTIAL_KEY_FILE=" + writeSecret(t, dir, "credential-key", credKey),
		"AGENTPLANE_ATTESTATION_KEY=" + attKey,
		"AGENTPLANE_GRPC_ADDR=127.0.0.1:0",
		"AGENTPLANE_METRICS_ADDR=",
		"AGENTPLANE_PROXY_ADDR=127.0.0.1:0",
		"AGENTPLANE_INGEST_ADDR=127.0.0.1:1",
		"AGENTPLANE_DRAIN_DELAY=0s",
		"AGENTPLANE_LOG_FORMAT=json",
		"AGENTPLANE_LOG_LEVEL=debug",
	}
	cmd.SysProcAttr = sameUID()
	var logs syncBuffer
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	grpcAddr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			_, _ = logs.Write(append(sc.Bytes(), '\n'))
			var line struct {
				Msg  string `json:"msg"`
				Addr string `json:"grpc_addr"`
			}
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "serving" {
				grpcAddr <- line.Addr
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		exited <- cmd.Wait()
	}()
	var addr string
	select {
	case addr = <-grpcAddr:
	case err := <-exited:
		t.Fatalf("credential exited early: %v\n%s", err, logs.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("credential never served:\n%s", logs.String())
	}

	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	waitServing(t, conn, addr) // readiness pings Redis: the password from the file works
	call := func(tok string) error {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
		_, err := credentialv1.NewCredentialServiceClient(conn).ResolveHandle(ctx, &credentialv1.ResolveHandleRequest{})
		return err
	}
	require.Equal(t, codes.Unauthenticated, status.Code(call("wrong-token")))
	err = call(token)
	require.NotEqual(t, codes.Unauthenticated, status.Code(err), "the token from the file is the service's: %v", err)

	secrets := map[string]string{"redis password": redisPassword, "internal token": token, "credential key": credKey, "attestation key": attKey}
	got := readAs(t, reader, sameUID(), cmd.Process.Pid)
	require.NotEmpty(t, got.EnvironErr, "environ of the service was readable")
	require.Contains(t, got.EnvironErr, "permission denied")
	require.NotEmpty(t, got.MemErr, "memory of the service was readable")
	require.Contains(t, got.MemErr, "permission denied")
	require.Empty(t, got.Mem)
	require.NotContains(t, got.Environ, marker)

	// The control: the same reader, same uid, reads a dumpable process's environment and memory.
	ctl := exec.Command("sleep", "600")
	ctl.Env = []string{"AGENTPLANE_TEST_MARKER=" + marker}
	ctl.SysProcAttr = sameUID()
	require.NoError(t, ctl.Start())
	t.Cleanup(func() { _ = ctl.Process.Kill(); _ = ctl.Wait() })
	open := readAs(t, reader, sameUID(), ctl.Process.Pid)
	require.Empty(t, open.EnvironErr)
	require.Contains(t, open.Environ, marker, "the reader can read a dumpable process of its uid")
	require.Empty(t, open.MemErr)
	require.NotEmpty(t, open.Mem)

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "credential did not stop cleanly:\n%s", logs.String())
	case <-time.After(60 * time.Second):
		t.Fatal("credential did not stop")
	}
	out := logs.String()
	require.Contains(t, out, "secret AGENTPLANE_ATTESTATION_KEY is given in the environment", "the plain form is warned about")
	for what, v := range secrets {
		require.NotContains(t, out, v, "the %s appears in the logs", what)
	}
}

// TestSecretFileErrorsAtStart: a secret file that cannot be read stops the real binary at
// start with a message naming the variable and the flag, and never the value of another.
func TestSecretFileErrorsAtStart(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "agentplane")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run(), "build agentplane")
	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.WriteFile(empty, []byte("\n"), 0o600))
	cmd := exec.Command(bin, "ingest")
	cmd.Env = []string{
		"AGENTPLANE_REDIS_URL=redis://:pw-not-printed@127.0.0.1:1/0",
		"AGENTPLANE_INTERNAL_TOKEN_FILE=" + empty,
	}
	out, err := cmd.CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "AGENTPLANE_INTERNAL_TOKEN_FILE (--internal-token-file): secret file "+empty+" is empty")
	require.NotContains(t, string(out), "pw-not-printed")
}

// TestDevSecretFlags: agentplane dev reads --internal-token-file and --redis-file, refuses a
// secret given both ways, warns about one on the command line, and prints no Redis password.
func TestDevSecretFlags(t *testing.T) {
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte("dev-token\n"), 0o600))
	urlFile := filepath.Join(dir, "redis")
	require.NoError(t, os.WriteFile(urlFile, []byte("redis://:pw@127.0.0.1:6379/0\n"), 0o600))

	var warn bytes.Buffer
	o := devOptions{internalTokenFile: tokenFile, redisURLFile: urlFile}
	require.NoError(t, o.readSecretFiles(&warn))
	require.Equal(t, "dev-token", o.internalToken)
	require.Equal(t, "redis://:pw@127.0.0.1:6379/0", o.redisURL)
	require.Empty(t, warn.String())
	require.Equal(t, "redis://xxxxx@127.0.0.1:6379/0", redact(o.redisURL))
	require.Equal(t, "redis://127.0.0.1:6379/0", redact("redis://127.0.0.1:6379/0"))

	o = devOptions{internalToken: "on-the-command-line", redisURL: "redis://127.0.0.1:6379"}
	require.NoError(t, o.readSecretFiles(&warn))
	require.Contains(t, warn.String(), "WARNING: --internal-token is on the command line")
	require.NotContains(t, warn.String(), "--redis ", "a URL without a password is no secret")
	require.NotContains(t, warn.String(), "on-the-command-line")

	o = devOptions{internalToken: "x", internalTokenFile: tokenFile}
	require.ErrorContains(t, o.readSecretFiles(io.Discard), "give either --internal-token or --internal-token-file, not both")
	o = devOptions{internalTokenFile: filepath.Join(dir, "missing")}
	require.ErrorContains(t, o.readSecretFiles(io.Discard), "--internal-token-file: cannot read the secret file")
}
