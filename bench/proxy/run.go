package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// runAll starts redis-server, the upstream, the credential service and the
// load generator as separate processes and stops them again.
func runAll(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("proxybench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	credBins := fs.String("credential-bin", "", "the credential service binary (services/credential/cmd/credential); a comma-separated list runs one service per binary on the same redis-server and upstream and measures each proxy in the same rounds (e.g. reference,candidate)")
	gomaxprocs := fs.Int("credential-gomaxprocs", 0, "GOMAXPROCS of every credential process (0: Go's default, the CPU count)")
	upstreamProcs := fs.Int("upstream-gomaxprocs", 0, "GOMAXPROCS of the fake upstream (0: Go's default)")
	pin := fs.String("pin", "", "taskset CPU list per process, e.g. credential=1,redis=0,upstream=0,load=0; empty: no pinning")
	var lo loadOptions
	lo.bind(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *credBins == "" {
		return errors.New("-credential-bin is required")
	}
	cpus, err := parsePin(*pin)
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "proxybench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	bins := strings.Split(*credBins, ",")
	ports := make([]int, 2+3*len(bins)) // redis, upstream, then grpc, proxy, metrics per binary
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return err
		}
	}
	addr := func(p int) string { return "127.0.0.1:" + strconv.Itoa(p) }
	// The children read the backing secret and the internal token from the
	// environment, never from a command line.
	secret, token := "sk-bench-"+randomText(12), randomText(16)
	_ = os.Setenv(secretEnv, secret)
	_ = os.Setenv(tokenEnv, token)

	var procs []*exec.Cmd
	defer func() { // stop in reverse start order
		for i := len(procs) - 1; i >= 0; i-- {
			_ = procs[i].Process.Signal(syscall.SIGTERM)
			_ = procs[i].Wait()
		}
	}()
	start := func(name string, env []string, bin string, argv ...string) (*exec.Cmd, error) {
		if c, ok := cpus[name]; ok {
			argv = append([]string{"-c", c, bin}, argv...)
			bin = "taskset"
		}
		cmd := exec.Command(bin, argv...)
		cmd.Env = append(os.Environ(), env...)
		cmd.Stderr = stderr
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("start %s: %w", name, err)
		}
		procs = append(procs, cmd)
		return cmd, nil
	}

	if _, err := start("redis", nil, "redis-server", "--bind", "127.0.0.1", "--port", strconv.Itoa(ports[0]),
		"--dir", dir, "--save", "", "--appendonly", "no", "--logfile", filepath.Join(dir, "redis.log")); err != nil {
		return err
	}
	var upEnv []string
	if *upstreamProcs > 0 {
		upEnv = []string{"GOMAXPROCS=" + strconv.Itoa(*upstreamProcs)}
	}
	up, err := start("upstream", upEnv, self, "upstream", "-addr", addr(ports[1]))
	if err != nil {
		return err
	}
	lo.upstreamPid = up.Process.Pid
	key := func() string { b := make([]byte, 32); _, _ = rand.Read(b); return base64.StdEncoding.EncodeToString(b) }
	credKey, attKey := key(), key() // shared: every service reads the same stored credentials
	var procsEnv []string
	if *gomaxprocs > 0 {
		procsEnv = []string{"GOMAXPROCS=" + strconv.Itoa(*gomaxprocs)}
	}
	for i, bin := range bins {
		p := ports[2+3*i:]
		cred, err := start("credential", append([]string{
			"AGENTPLANE_REDIS_URL=redis://" + addr(ports[0]),
			"AGENTPLANE_GRPC_ADDR=" + addr(p[0]),
			"AGENTPLANE_PROXY_ADDR=" + addr(p[1]),
			"AGENTPLANE_METRICS_ADDR=" + addr(p[2]),
			"AGENTPLANE_INTERNAL_TOKEN=" + token,
			"AGENTPLANE_CREDENTIAL_KEY=" + credKey,
			"AGENTPLANE_ATTESTATION_KEY=" + attKey,
			"AGENTPLANE_PROVIDER_UPSTREAM=http://" + addr(ports[1]),
			"AGENTPLANE_INGEST_ADDR=127.0.0.1:1", // ingest route unused here
			"AGENTPLANE_SESSION_ADDR=",           // no usage reports
			"AGENTPLANE_LOG_LEVEL=warn",
			"AGENTPLANE_DRAIN_DELAY=0s",
		}, procsEnv...), bin)
		if err != nil {
			return err
		}
		if err := waitListening(ctx, addr(p[1])); err != nil {
			return err
		}
		lo.proxies = append(lo.proxies, proxyTarget{name: filepath.Base(bin), url: "http://" + addr(p[1]), pid: cred.Process.Pid})
		fmt.Fprintf(stdout, "proxy %s: credential pid %d\n", filepath.Base(bin), cred.Process.Pid)
	}
	for _, p := range []int{ports[0], ports[1]} {
		if err := waitListening(ctx, addr(p)); err != nil {
			return err
		}
	}

	lo.grpcAddr, lo.upstreamURL, lo.redisAddr = addr(ports[2]), "http://"+addr(ports[1]), addr(ports[0])
	fmt.Fprintf(stdout, "processes: redis-server, upstream (GOMAXPROCS %s), %d credential (GOMAXPROCS %s), load; pinning: %s\n",
		gomaxprocsText(*upstreamProcs), len(bins), gomaxprocsText(*gomaxprocs), pinText(*pin))
	cmd := exec.CommandContext(ctx, self, append([]string{"load"}, lo.args()...)...)
	if c, ok := cpus["load"]; ok {
		cmd = exec.CommandContext(ctx, "taskset", append([]string{"-c", c, self, "load"}, lo.args()...)...)
	}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	return cmd.Run()
}

func parsePin(s string) (map[string]string, error) {
	m := map[string]string{}
	if s == "" {
		return m, nil
	}
	for f := range strings.SplitSeq(s, ",") {
		name, cpu, ok := strings.Cut(f, "=")
		switch name {
		case "credential", "redis", "upstream", "load":
		default:
			ok = false
		}
		if !ok || cpu == "" {
			return nil, fmt.Errorf("-pin: want name=cpus with name one of credential, redis, upstream, load; got %q", f)
		}
		m[name] = cpu
	}
	return m, nil
}

func gomaxprocsText(n int) string {
	if n <= 0 {
		return "default"
	}
	return strconv.Itoa(n)
}

func pinText(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func waitListening(ctx context.Context, addr string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			return c.Close()
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%s not listening: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func randomText(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}
