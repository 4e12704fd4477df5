package server

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/pkg/testaddr"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/redistest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const internalTok = "internal-test-token"

// upstream is a real local HTTP server recording what it receives.
type upstream struct {
	srv *httptest.Server
	mu  sync.Mutex
	got []*http.Request
	hit map[string]int
}

func newUpstream(t testing.TB) *upstream {
	u := &upstream{hit: map[string]int{}}
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/base/bench" {
			_, _ = io.WriteString(w, `{"ok":true}`)
			return
		}
		u.mu.Lock()
		u.got = append(u.got, r.Clone(context.Background()))
		u.hit[r.URL.Path]++
		u.mu.Unlock()
		if echo(w, r) {
			return
		}
		switch r.URL.Path {
		case "/base/redirect":
			http.Redirect(w, r, "/base/elsewhere", http.StatusFound)
		case "/base/cookie":
			w.Header().Set("Set-Cookie", "session=abc")
			w.Header().Set("Connection", "X-Hop-Resp")
			w.Header().Set("X-Hop-Resp", "1")
			w.Header().Set("Keep-Alive", "timeout=5")
			w.Header().Set("X-Agentplane-Attestation", "leak")
			w.Header().Set("X-Kept", "yes")
			_, _ = io.WriteString(w, "ok")
		default:
			_, _ = io.WriteString(w, `{"ok":true}`)
		}
	}))
	t.Cleanup(u.srv.Close)
	return u
}

func (u *upstream) last() *http.Request {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.got) == 0 {
		return nil
	}
	return u.got[len(u.got)-1]
}

// fakeIngest is a real gRPC IngestService recording requests.
type fakeIngest struct {
	ingestv1.UnimplementedIngestServiceServer
	mu      sync.Mutex
	ingests []*ingestv1.IngestRequest
	exports []*ingestv1.ExportRequest
	creates []*ingestv1.CreateRuntimeSessionRequest
	auth    []string
}

func (f *fakeIngest) record(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.auth = append(f.auth, strings.Join(md.Get("authorization"), ","))
}

func (f *fakeIngest) Ingest(ctx context.Context, r *ingestv1.IngestRequest) (*ingestv1.IngestResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(ctx)
	f.ingests = append(f.ingests, r)
	return &ingestv1.IngestResponse{Applied: int32(len(r.GetItems())), Cursor: "1-0"}, nil
}

// CreateRuntimeSession records the registration the proxy makes before its
// first write to a runtime session.
func (f *fakeIngest) CreateRuntimeSession(_ context.Context, r *ingestv1.CreateRuntimeSessionRequest) (*ingestv1.CreateRuntimeSessionResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.creates = append(f.creates, r)
	return &ingestv1.CreateRuntimeSessionResponse{RuntimeSession: r.GetRuntimeSession()}, nil
}

func (f *fakeIngest) Export(ctx context.Context, r *ingestv1.ExportRequest) (*ingestv1.ExportResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(ctx)
	f.exports = append(f.exports, r)
	return &ingestv1.ExportResponse{Items: []*ingestv1.Item{{ItemId: "m1", Type: ingestv1.ItemType_ITEM_TYPE_MESSAGE, Version: 2, Payload: []byte(`{"text":"hi"}`)}}, Cursor: "9-0"}, nil
}

type harness struct {
	cfg      Config
	client   credentialv1.CredentialServiceClient
	proxyURL string // http://host:port
	metrics  string
	up       *upstream
	ingest   *fakeIngest
	attKey   []byte
	http     *http.Client
	rdb      *redistest.Server
}

func startHarness(t testing.TB, opts ...func(*Config)) *harness {
	h := &harness{up: newUpstream(t), ingest: &fakeIngest{}, rdb: redistest.Start(t)}
	il := testaddr.Listen(t)
	gs := grpc.NewServer()
	ingestv1.RegisterIngestServiceServer(gs, h.ingest)
	go func() { _ = gs.Serve(il) }()
	t.Cleanup(gs.Stop)

	h.attKey = []byte(strings.Repeat("a", 32))
	cfg := DefaultConfig()
	cfg.RedisURL = h.rdb.URL()
	cfg.InternalToken = internalTok
	cfg.DrainDelay = 0
	cfg.LogFormat = "text"
	cfg.LogLevel = slog.LevelError
	cfg.CredentialKey = base64.StdEncoding.EncodeToString([]byte(strings.Repeat("k", 32)))
	cfg.AttestationKey = base64.StdEncoding.EncodeToString(h.attKey)
	cfg.ProviderUpstream = h.up.srv.URL + "/base"
	cfg.BackendUpstream = h.up.srv.URL + "/backend"
	cfg.IngestAddr = il.Addr().String()
	cfg.SessionAddr = "" // no session service here: usage is read, not reported
	cfg.OverlapWindow = time.Minute
	// The tests' git http-backend listens on loopback, which the git
	// route's address policy refuses unless named (never by default).
	cfg.GitNetworks = "127.0.0.1"
	for _, o := range opts {
		o(&cfg)
	}

	h.cfg = cfg
	h.client, h.proxyURL, h.metrics = startService(t, cfg)
	h.http = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	t.Cleanup(h.http.CloseIdleConnections)
	return h
}

// startService runs one credential service process with cfg and returns
// its gRPC client, proxy URL and metrics URL; it stops with the test.
func startService(t testing.TB, cfg Config) (client credentialv1.CredentialServiceClient, proxyURL, metricsURL string) {
	s := runService(t, cfg)
	t.Cleanup(func() {
		if err := s.stop(); err != nil {
			t.Error(err)
		}
	})
	return s.client, s.proxyURL, s.metricsURL
}

type running struct {
	client                         credentialv1.CredentialServiceClient
	grpcAddr, proxyURL, metricsURL string
	stop                           func() error // begins the shutdown and waits for RunWith's result
}

// runService runs one credential service process with cfg until stop.
func runService(t testing.TB, cfg Config) running {
	gl, pl, ml := testaddr.Listen(t), testaddr.Listen(t), testaddr.Listen(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- RunWith(ctx, cfg, Listeners{GRPC: gl, Proxy: pl, Metrics: ml}) }()
	conn, err := grpcclient.Dial(gl.Addr().String(), internalTok)
	require.NoError(t, err)
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() {
			_ = conn.Close()
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(30 * time.Second):
				runErr = errors.New("server did not stop")
			}
		})
		return runErr
	}
	return running{client: credentialv1.NewCredentialServiceClient(conn), grpcAddr: gl.Addr().String(),
		proxyURL: "http://" + pl.Addr().String(), metricsURL: "http://" + ml.Addr().String() + "/metrics", stop: stop}
}

// replica starts a second credential service on the same Redis and keys,
// with its own resolution cache: the deployment has several.
func (h *harness) replica(t testing.TB) credentialv1.CredentialServiceClient {
	c, _, _ := startService(t, h.cfg)
	return c
}

var bg = context.Background()

type minted struct {
	handle string
	ref    string
	grant  *credentialv1.Grant
}

func (h *harness) put(t testing.TB, session, secret string, class credentialv1.CredentialClass) string {
	var resp *credentialv1.PutBackingCredentialResponse
	require.Eventually(t, func() bool {
		var err error
		resp, err = h.client.PutBackingCredential(bg, &credentialv1.PutBackingCredentialRequest{SessionId: session, CredentialClass: class, Secret: secret})
		return err == nil
	}, 20*time.Second, 20*time.Millisecond)
	return resp.GetCredentialRef()
}

func member(session string) *credentialv1.Member {
	return &credentialv1.Member{SessionId: session, RuntimeSessionId: "rs-" + session, UserId: "user", OrgId: "org"}
}

func (h *harness) mint(t testing.TB, sandbox, dir, session, secret string, contract credentialv1.RuntimeContract, fence uint64) minted {
	ref := h.put(t, session, secret, credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC)
	resp, err := h.client.MintHandle(bg, &credentialv1.MintHandleRequest{
		Scope: &credentialv1.Scope{SandboxId: sandbox, Directory: dir}, Member: member(session), CredentialRef: ref,
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Contract: contract, FenceToken: fence, AllocationId: "alloc-1",
	})
	require.NoError(t, err)
	return minted{handle: resp.GetHandle(), ref: ref, grant: resp.GetGrant()}
}

func (h *harness) adopt(t *testing.T, sandbox, dir, session, secret string, fence uint64) (minted, error) {
	ref := h.put(t, session, secret, credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC)
	resp, err := h.client.AdoptHandle(bg, &credentialv1.AdoptHandleRequest{
		Scope: &credentialv1.Scope{SandboxId: sandbox, Directory: dir}, Member: member(session), CredentialRef: ref,
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, FenceToken: fence,
	})
	return minted{handle: resp.GetHandle(), ref: ref, grant: resp.GetGrant()}, err
}

func (h *harness) do(t *testing.T, method, path, handle string, hdr http.Header, body io.Reader) *http.Response {
	req, err := http.NewRequest(method, h.proxyURL+path, body)
	require.NoError(t, err)
	for k, v := range hdr {
		req.Header[k] = v
	}
	if handle != "" {
		req.Header.Set("Authorization", "Bearer "+handle)
	}
	resp, err := h.http.Do(req)
	require.NoError(t, err)
	t.Cleanup(func() { _ = resp.Body.Close() })
	return resp
}

// raw sends a request line exactly as given (the Go client would clean or
// escape some paths) and returns the status code.
func (h *harness) raw(t *testing.T, requestURI, handle string) int {
	c, err := net.Dial("tcp", strings.TrimPrefix(h.proxyURL, "http://"))
	require.NoError(t, err)
	defer c.Close()
	_, err = io.WriteString(c, "GET "+requestURI+" HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer "+handle+"\r\nConnection: close\r\n\r\n")
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	_ = resp.Body.Close()
	return resp.StatusCode
}
