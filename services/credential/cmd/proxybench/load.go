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
	grpcAddr    string
	proxyURL    string
	upstreamURL string
	redisAddr   string
	proxyPID    int
}

func (o *loadOptions) bind(fs *flag.FlagSet) {
	fs.IntVar(&o.rounds, "rounds", 5, "rounds; each measures redis, direct and proxy")
	fs.IntVar(&o.samples, "samples", 2000, "sequential requests per round and kind (concurrency 1)")
	fs.IntVar(&o.conc, "conc", 32, "concurrent keep-alive connections in the throughput phases")
	fs.DurationVar(&o.duration, "duration", 3*time.Second, "length of each throughput phase")
}

func (o *loadOptions) args() []string {
	return []string{
		"-rounds", strconv.Itoa(o.rounds), "-samples", strconv.Itoa(o.samples), "-conc", strconv.Itoa(o.conc),
		"-duration", o.duration.String(), "-grpc", o.grpcAddr, "-proxy", o.proxyURL, "-upstream", o.upstreamURL,
		"-redis", o.redisAddr, "-proxy-pid", strconv.Itoa(o.proxyPID),
	}
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
	fs.StringVar(&o.grpcAddr, "grpc", "", "credential gRPC address")
	fs.StringVar(&o.proxyURL, "proxy", "", "credential proxy base URL")
	fs.StringVar(&o.upstreamURL, "upstream", "", "upstream base URL")
	fs.StringVar(&o.redisAddr, "redis", "", "redis-server address")
	fs.IntVar(&o.proxyPID, "proxy-pid", 0, "pid of the credential process (CPU per request)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	handle, err := mint(ctx, o.grpcAddr, os.Getenv(tokenEnv), os.Getenv(secretEnv))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(&redis.Options{Addr: o.redisAddr, PoolSize: 4})
	defer rdb.Close()
	direct := newTarget(o.upstreamURL+"/v1/chat/completions", "Bearer "+os.Getenv(secretEnv), o.conc)
	proxied := newTarget(o.proxyURL+"/s/sbx-bench/provider/v1/chat/completions", "Bearer "+handle, o.conc)
	ping := func(ctx context.Context) error { return rdb.Ping(ctx).Err() }

	for range 200 { // warm connections, the resolution cache and the runtimes
		for _, f := range []func(context.Context) error{ping, direct.call, proxied.call} {
			if err := f(ctx); err != nil {
				return err
			}
		}
	}

	fmt.Fprintf(out, "rounds %d: %d sequential requests per kind (interleaved request by request), then %d connections for %s per kind (order alternating per round)\n",
		o.rounds, o.samples, o.conc, o.duration)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "round\tredis p50 µs\tredis p99\tdirect p50\tdirect p99\tproxy p50\tproxy p99\tadded p50\tgoal\tdirect req/s\tproxy req/s\tproxy cpu µs/req\t")
	var rows []row
	for i := range o.rounds {
		var r row
		lat := make([][]time.Duration, 3)
		for j := range lat {
			lat[j] = make([]time.Duration, 0, o.samples)
		}
		for range o.samples {
			for j, f := range []func(context.Context) error{ping, direct.call, proxied.call} {
				t0 := time.Now()
				if err := f(ctx); err != nil {
					return err
				}
				lat[j] = append(lat[j], time.Since(t0))
			}
		}
		for j := range lat {
			r.p50[j], r.p99[j] = percentiles(lat[j])
		}
		order := []int{1, 2}
		if i%2 == 1 {
			order = []int{2, 1}
		}
		for _, k := range order {
			t := direct
			if k == 2 {
				t = proxied
			}
			cpu0 := procCPU(o.proxyPID)
			n, d, err := throughput(ctx, t, o.conc, o.duration)
			if err != nil {
				return err
			}
			r.rps[k] = float64(n) / d.Seconds()
			if k == 2 && n > 0 {
				r.proxyCPU = float64((procCPU(o.proxyPID) - cpu0).Microseconds()) / float64(n)
			}
		}
		rows = append(rows, r)
		r.print(tw, strconv.Itoa(i+1))
	}
	median(rows).print(tw, "median")
	return tw.Flush()
}

// row is one round: index 0 redis, 1 direct, 2 proxy.
type row struct {
	p50, p99, rps [3]float64
	proxyCPU      float64
}

func (r row) print(w io.Writer, name string) {
	added := r.p50[2] - r.p50[1]
	goal := r.p50[0] + 100
	fmt.Fprintf(w, "%s\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t≤%.0f\t%.0f\t%.0f\t%.0f\t\n", name,
		r.p50[0], r.p99[0], r.p50[1], r.p99[1], r.p50[2], r.p99[2], added, goal, r.rps[1], r.rps[2], r.proxyCPU)
}

// median is the per-column median over rounds.
func median(rows []row) row {
	var m row
	col := func(get func(r row) float64) float64 {
		v := make([]float64, len(rows))
		for i, r := range rows {
			v[i] = get(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	for j := range 3 {
		m.p50[j] = col(func(r row) float64 { return r.p50[j] })
		m.p99[j] = col(func(r row) float64 { return r.p99[j] })
		m.rps[j] = col(func(r row) float64 { return r.rps[j] })
	}
	m.proxyCPU = col(func(r row) float64 { return r.proxyCPU })
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
