package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/pkg/grpcclient"
)

const (
	secretEnv = "PROXYBENCH_SECRET"         // the backing credential (upstream, load)
	tokenEnv  = "PROXYBENCH_INTERNAL_TOKEN" // the service-to-service token (load)
)

// chatRequest is a small OpenAI chat completion request.
const chatRequest = `{"model":"bench","messages":[{"role":"user","content":"say ok"}],"max_tokens":1}`

type loadOptions struct {
	rounds      int
	samples     int           // sequential requests per round and kind
	conc        int           // keep-alive connections in the throughput phase
	duration    time.Duration // per throughput phase
	generator   string        // throughput phase: "wrk" or "go"
	grpcAddr    string
	upstreamURL string
	upstreamPid int // for its CPU per request
	redisAddr   string
	proxies     []proxyTarget
}

// proxyTarget is one credential service's proxy.
type proxyTarget struct {
	name string
	url  string
	pid  int // its process, for CPU per request
}

func (o *loadOptions) bind(fs *flag.FlagSet) {
	fs.IntVar(&o.rounds, "rounds", 5, "rounds; each measures redis, direct and proxy")
	fs.IntVar(&o.samples, "samples", 2000, "sequential requests per round and kind (concurrency 1)")
	fs.IntVar(&o.conc, "conc", 32, "concurrent keep-alive connections in the throughput phases")
	fs.DurationVar(&o.duration, "duration", 3*time.Second, "length of each throughput phase")
	fs.StringVar(&o.generator, "generator", "auto", "throughput load generator: wrk (one thread, epoll; apt-get install wrk), go (net/http client, one goroutine per connection) or auto (wrk when on PATH)")
}

func (o *loadOptions) args() []string {
	return []string{
		"-rounds", strconv.Itoa(o.rounds), "-samples", strconv.Itoa(o.samples), "-conc", strconv.Itoa(o.conc),
		"-duration", o.duration.String(), "-generator", o.generator, "-grpc", o.grpcAddr, "-upstream", o.upstreamURL, "-upstream-pid", strconv.Itoa(o.upstreamPid), "-redis", o.redisAddr,
		"-proxies", o.proxiesText(),
	}
}

func (o *loadOptions) proxiesText() string {
	var parts []string
	for _, p := range o.proxies {
		parts = append(parts, p.name+"@"+p.url+"@"+strconv.Itoa(p.pid))
	}
	return strings.Join(parts, ",")
}

func (o *loadOptions) parseProxies(s string) error {
	for f := range strings.SplitSeq(s, ",") {
		parts := strings.Split(f, "@")
		if len(parts) != 3 {
			return fmt.Errorf("-proxies: want name@url@pid, got %q", f)
		}
		pid, err := strconv.Atoi(parts[2])
		if err != nil {
			return fmt.Errorf("-proxies: %w", err)
		}
		o.proxies = append(o.proxies, proxyTarget{name: parts[0], url: parts[1], pid: pid})
	}
	return nil
}

// target is one way of making the chat request.
type target struct {
	url    string
	auth   string
	client *http.Client
}

func newTarget(url, auth string, conns int) target {
	tr := &http.Transport{Proxy: nil, MaxIdleConns: conns, MaxIdleConnsPerHost: conns, DisableCompression: true}
	return target{url: url, auth: auth, client: &http.Client{Transport: tr}}
}

func (t target) call(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.url, strings.NewReader(chatRequest))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", t.auth)
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: status %d", t.url, resp.StatusCode)
	}
	return nil
}

func runLoad(ctx context.Context, args []string, out io.Writer) error {
	var o loadOptions
	fs := flag.NewFlagSet("proxybench load", flag.ContinueOnError)
	o.bind(fs)
	fs.StringVar(&o.grpcAddr, "grpc", "", "credential gRPC address (mints the handle)")
	fs.StringVar(&o.upstreamURL, "upstream", "", "upstream base URL")
	fs.IntVar(&o.upstreamPid, "upstream-pid", 0, "upstream process id (CPU per request)")
	fs.StringVar(&o.redisAddr, "redis", "", "redis-server address")
	proxies := fs.String("proxies", "", "name@url@pid of each credential proxy")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := o.parseProxies(*proxies); err != nil {
		return err
	}
	handle, err := mint(ctx, o.grpcAddr, os.Getenv(tokenEnv), os.Getenv(secretEnv))
	if err != nil {
		return err
	}
	if o.generator == "auto" {
		o.generator = "go"
		if _, err := exec.LookPath("wrk"); err == nil {
			o.generator = "wrk"
		}
	}
	var wrkScript string
	switch o.generator {
	case "go":
	case "wrk":
		if wrkScript, err = writeWrkScript(); err != nil {
			return err
		}
		defer os.RemoveAll(filepath.Dir(wrkScript))
	default:
		return fmt.Errorf("-generator: want wrk, go or auto, got %q", o.generator)
	}
	rdb := redis.NewClient(&redis.Options{Addr: o.redisAddr, PoolSize: 4})
	defer rdb.Close()

	// kinds[0] is the Redis round trip, kinds[1] the direct call, then one per proxy.
	kinds := []kind{
		{name: "redis PING", call: func(ctx context.Context) error { return rdb.Ping(ctx).Err() }},
		{name: "direct", http: newTarget(o.upstreamURL+"/v1/chat/completions", "Bearer "+os.Getenv(secretEnv), o.conc)},
	}
	for _, p := range o.proxies {
		kinds = append(kinds, kind{name: "proxy " + p.name, pid: p.pid,
			http: newTarget(p.url+"/s/sbx-bench/provider/v1/chat/completions", "Bearer "+handle, o.conc)})
	}
	for i := range kinds {
		if kinds[i].call == nil {
			kinds[i].call = kinds[i].http.call
		}
	}

	for range 200 { // warm connections, the resolution cache and the runtimes
		for _, k := range kinds {
			if err := k.call(ctx); err != nil {
				return err
			}
		}
	}

	fmt.Fprintf(out, "%d rounds: %d sequential requests per kind (Go net/http client, interleaved request by request), then %d connections for %s per HTTP kind (generator %s, order rotating per round)\n",
		o.rounds, o.samples, o.conc, o.duration, o.generator)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "round\tkind\tp50 µs\tp99 µs\tadded p50 µs\tgoal ≤ µs\treq/s\tproxy cpu µs/req\tload cpu µs/req\tupstream cpu µs/req\t")
	var rounds [][]result
	for i := range o.rounds {
		res := make([]result, len(kinds))
		lat := make([][]time.Duration, len(kinds))
		for range o.samples {
			for j, k := range kinds {
				t0 := time.Now()
				if err := k.call(ctx); err != nil {
					return err
				}
				lat[j] = append(lat[j], time.Since(t0))
			}
		}
		for j := range kinds {
			res[j].p50, res[j].p99 = percentiles(lat[j])
		}
		for n := range len(kinds) - 1 { // rotate which HTTP kind goes first
			j := 1 + (i+n)%(len(kinds)-1)
			k := kinds[j]
			cpu0, up0 := procCPU(k.pid), procCPU(o.upstreamPid)
			var calls int64
			var d, loadCPU time.Duration
			if o.generator == "wrk" {
				calls, d, loadCPU, err = wrkThroughput(ctx, wrkScript, k.http, o.conc, o.duration)
			} else {
				self0 := procCPU(os.Getpid())
				calls, d, err = throughput(ctx, k.http, o.conc, o.duration)
				loadCPU = procCPU(os.Getpid()) - self0
			}
			if err != nil {
				return err
			}
			res[j].rps = float64(calls) / d.Seconds()
			if calls > 0 {
				res[j].loadCPU = float64(loadCPU.Microseconds()) / float64(calls)
				res[j].upstreamCPU = float64((procCPU(o.upstreamPid) - up0).Microseconds()) / float64(calls)
			}
			if k.pid != 0 && calls > 0 {
				res[j].cpu = float64((procCPU(k.pid) - cpu0).Microseconds()) / float64(calls)
			}
		}
		rounds = append(rounds, res)
		printRound(tw, strconv.Itoa(i+1), kinds, res)
	}
	printRound(tw, "median", kinds, medians(rounds))
	return tw.Flush()
}

type kind struct {
	name string
	call func(context.Context) error
	http target
	pid  int
}

// result is one kind in one round (µs, req/s).
type result struct{ p50, p99, rps, cpu, loadCPU, upstreamCPU float64 }

func printRound(w io.Writer, round string, kinds []kind, res []result) {
	for j, k := range kinds {
		added, goal, rps, cpu, loadCPU, upCPU := "", "", "", "", "", ""
		if j >= 2 {
			added = fmt.Sprintf("%.0f", res[j].p50-res[1].p50)
			goal = fmt.Sprintf("%.0f", res[0].p50+100)
			cpu = fmt.Sprintf("%.0f", res[j].cpu)
		}
		if j >= 1 {
			rps = fmt.Sprintf("%.0f", res[j].rps)
			loadCPU = fmt.Sprintf("%.0f", res[j].loadCPU)
			upCPU = fmt.Sprintf("%.0f", res[j].upstreamCPU)
		}
		fmt.Fprintf(w, "%s\t%s\t%.0f\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t\n", round, k.name, res[j].p50, res[j].p99, added, goal, rps, cpu, loadCPU, upCPU)
	}
}

// medians is the per-kind, per-column median over rounds.
func medians(rounds [][]result) []result {
	m := make([]result, len(rounds[0]))
	col := func(j int, get func(r result) float64) float64 {
		v := make([]float64, len(rounds))
		for i, r := range rounds {
			v[i] = get(r[j])
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	for j := range m {
		m[j] = result{
			p50: col(j, func(r result) float64 { return r.p50 }), p99: col(j, func(r result) float64 { return r.p99 }),
			rps: col(j, func(r result) float64 { return r.rps }), cpu: col(j, func(r result) float64 { return r.cpu }),
			loadCPU: col(j, func(r result) float64 { return r.loadCPU }), upstreamCPU: col(j, func(r result) float64 { return r.upstreamCPU }),
		}
	}
	return m
}

func percentiles(d []time.Duration) (p50, p99 float64) {
	slices.Sort(d)
	us := func(x time.Duration) float64 { return float64(x.Nanoseconds()) / 1e3 }
	return us(d[len(d)/2]), us(d[len(d)*99/100])
}

// throughput runs conc workers calling t for d and returns the completed calls.
func throughput(ctx context.Context, t target, conc int, d time.Duration) (int64, time.Duration, error) {
	var n atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, conc)
	stop := time.Now().Add(d)
	start := time.Now()
	for range conc {
		wg.Go(func() {
			for time.Now().Before(stop) {
				if err := t.call(ctx); err != nil {
					errs <- err
					return
				}
				n.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	return n.Load(), elapsed, <-errs
}

// wrkScript makes wrk send the same chat request as the Go client; the
// Authorization value comes from the environment, never a file or argv.
const wrkScript = `wrk.method = "POST"
wrk.body = '` + chatRequest + `'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = os.getenv("PROXYBENCH_AUTH")
`

func writeWrkScript() (string, error) {
	dir, err := os.MkdirTemp("", "proxybench-wrk-")
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "post.lua")
	return path, os.WriteFile(path, []byte(wrkScript), 0o600)
}

var (
	wrkDone   = regexp.MustCompile(`(\d+) requests in ([0-9.]+)(us|ms|s|m),`)
	wrkFailed = regexp.MustCompile(`(Non-2xx or 3xx responses|Socket errors):.*`)
)

// wrkThroughput runs wrk (one thread, conc connections) against t for d. It
// returns the completed requests, wrk's elapsed time and its CPU time; any
// non-2xx answer or socket error fails the run.
func wrkThroughput(ctx context.Context, script string, t target, conc int, d time.Duration) (int64, time.Duration, time.Duration, error) {
	cmd := exec.CommandContext(ctx, "wrk", "-t", "1", "-c", strconv.Itoa(conc), "-d", d.String(), "-s", script, t.url)
	cmd.Env = append(os.Environ(), "PROXYBENCH_AUTH="+t.auth)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("wrk: %w", err)
	}
	if m := wrkFailed.Find(out); m != nil {
		return 0, 0, 0, fmt.Errorf("wrk against %s: %s", t.url, m)
	}
	m := wrkDone.FindSubmatch(out)
	if m == nil {
		return 0, 0, 0, fmt.Errorf("wrk: unexpected output %q", out)
	}
	n, _ := strconv.ParseInt(string(m[1]), 10, 64)
	elapsed, err := time.ParseDuration(string(m[2]) + string(m[3]))
	if err != nil {
		return 0, 0, 0, err
	}
	cpu := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	return n, elapsed, cpu, nil
}

// procCPU is the user+system CPU time of pid (Linux /proc, clock ticks of 10 ms).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// Fields after the parenthesised command name; utime and stime are 14 and 15.
	i := bytes.LastIndexByte(b, ')')
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * 10 * time.Millisecond
}

// mint does what the sandbox service does for a route: store the backing
// credential, then MintHandle for the scope under the owner's fencing token.
func mint(ctx context.Context, addr, token, secret string) (string, error) {
	conn, err := grpcclient.Dial(addr, token)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	c := credentialv1.NewCredentialServiceClient(conn)
	var put *credentialv1.PutBackingCredentialResponse
	deadline := time.Now().Add(30 * time.Second)
	for { // the service may still be starting
		put, err = c.PutBackingCredential(ctx, &credentialv1.PutBackingCredentialRequest{
			SessionId: "ses-bench", CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: secret,
		})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("PutBackingCredential: %w", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	resp, err := c.MintHandle(ctx, &credentialv1.MintHandleRequest{
		Scope:         &credentialv1.Scope{SandboxId: "sbx-bench", Directory: "/workspace/repo"},
		Member:        &credentialv1.Member{SessionId: "ses-bench", RuntimeSessionId: "rs-bench", UserId: "user-bench", OrgId: "org-bench"},
		CredentialRef: put.GetCredentialRef(), CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC,
		Contract:   credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE,
		FenceToken: 1, AllocationId: "alloc-bench",
	})
	if err != nil {
		return "", fmt.Errorf("MintHandle: %w", err)
	}
	if resp.GetHandle() == "" {
		return "", errors.New("MintHandle returned no handle")
	}
	return resp.GetHandle(), nil
}
