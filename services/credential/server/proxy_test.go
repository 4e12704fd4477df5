package server

import (
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/services/credential/attestation"
)

const (
	wt = credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE
	ps = credentialv1.RuntimeContract_RUNTIME_CONTRACT_PER_SESSION
)

// Every header a caller must not pass upstream, by name.
var callerHeaders = []string{
	"Proxy-Authorization", "Cookie", "Cookie2",
	"X-Api-Key", "Api-Key", "Openai-Api-Key", "X-Goog-Api-Key", "Anthropic-Api-Key", "X-Auth-Token",
	"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "X-Real-Ip",
	"Keep-Alive", "Te", "Trailer", "Upgrade", "Proxy-Connection", "X-Hop-Named",
	"X-Agentplane-Sandbox", "X-Agentplane-Attestation", "X-Agentplane-User",
}

func mixedCase(s string) string {
	b := []byte(strings.ToLower(s))
	for i := 0; i < len(b); i += 2 {
		b[i] = strings.ToUpper(string(b[i]))[0]
	}
	return string(b)
}

func TestProxyProviderHeaders(t *testing.T) {
	h := startHarness(t)
	const secret = "sk-backing-secret-123"
	m := h.mint(t, "sbx-a", "/w/repo", "s1", secret, wt, 100)
	require.True(t, strings.HasPrefix(m.handle, "aph_"))

	for _, name := range callerHeaders {
		for _, spelling := range []string{name, strings.ToLower(name), strings.ToUpper(name), mixedCase(name)} {
			t.Run(spelling, func(t *testing.T) {
				hdr := http.Header{spelling: {"caller-value"}, "Openai-Beta": {"kept"}, "Content-Type": {"application/json"}}
				if strings.EqualFold(name, "X-Hop-Named") {
					hdr["cOnNeCtIoN"] = []string{spelling}
				}
				resp := h.do(t, "POST", "/s/sbx-a/provider/v1/chat/completions?stream=false", m.handle, hdr, strings.NewReader(`{"model":"m"}`))
				require.Equal(t, http.StatusOK, resp.StatusCode)
				got := h.up.last()
				require.Equal(t, "/base/v1/chat/completions", got.URL.Path)
				require.Equal(t, "stream=false", got.URL.RawQuery)
				if strings.EqualFold(name, attestation.Header) {
					require.Len(t, got.Header.Values(name), 1, "only the proxy's own attestation")
				} else {
					require.Empty(t, got.Header.Values(name), "caller header %s reached the upstream", spelling)
				}
				require.Equal(t, []string{"Bearer " + secret}, got.Header.Values("Authorization"))
				require.Equal(t, "kept", got.Header.Get("OpenAI-Beta"))
				require.Empty(t, got.Header.Values("X-Forwarded-For"))
				c, err := attestation.Verify(h.attKey, got.Header.Get(attestation.Header), time.Now())
				require.NoError(t, err)
				require.Equal(t, "user", c.UserID)
				require.Equal(t, "sbx-a", c.SandboxID)
				require.Equal(t, "/w/repo", c.Directory)
				require.NotEmpty(t, c.SecretDigest)
				require.NotContains(t, c.SecretDigest, secret)
				for _, v := range got.Header {
					for _, x := range v {
						require.NotContains(t, x, "caller-value")
						require.NotContains(t, x, m.handle, "the handle never goes upstream")
					}
				}
			})
		}
	}

	t.Run("caller Authorization is replaced", func(t *testing.T) {
		req, _ := http.NewRequest("GET", h.proxyURL+"/s/sbx-a/backend/x", nil)
		req.Header["aUtHoRiZaTiOn"] = []string{"Bearer " + m.handle}
		resp, err := h.http.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		got := h.up.last()
		require.Equal(t, "/backend/x", got.URL.Path)
		require.Equal(t, []string{"Bearer " + secret}, got.Header.Values("Authorization"))
	})
}

func TestProxyResponseHeadersAndRedirects(t *testing.T) {
	h := startHarness(t)
	m := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)

	resp := h.do(t, "GET", "/s/sbx-a/provider/cookie", m.handle, nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	for _, n := range []string{"Set-Cookie", "X-Hop-Resp", "Keep-Alive", "X-Agentplane-Attestation"} {
		require.Empty(t, resp.Header.Values(n), n)
	}
	require.Equal(t, "yes", resp.Header.Get("X-Kept"))

	resp = h.do(t, "GET", "/s/sbx-a/provider/redirect", m.handle, nil, nil)
	require.Equal(t, http.StatusFound, resp.StatusCode, "the redirect goes back to the caller")
	h.up.mu.Lock()
	defer h.up.mu.Unlock()
	require.Equal(t, 1, h.up.hit["/base/redirect"])
	require.Zero(t, h.up.hit["/base/elsewhere"], "the proxy never follows redirects")
}

func TestProxyPathRefusalsRoutesAndSandbox(t *testing.T) {
	h := startHarness(t)
	m := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)
	other := h.mint(t, "sbx-b", "/w/repo", "s2", "sk-2", wt, 100)

	for _, p := range []string{
		"/s/sbx-a/provider/../x", "/s/sbx-a/provider/./x", "/s/sbx-a//provider/x", "/s/sbx-a/provider//x",
		"/s/sbx-a/provider/a\\b", "/s/sbx-a/provider/a%2fb", "/s/sbx-a/provider/a%2Fb", "/s/sbx-a/provider/a%5cb",
		"/s/sbx-a/provider/%2e%2e/x", "/s/sbx-a/provider/%2E%2e/x", "/s/sbx-a/provider/%252f", "/s/sbx-a/provider/%252e%252e/x",
		"/s/sbx-a/provider/%25", "/s/sbx-a/%2e%2e/sbx-b/provider/x",
	} {
		require.Equal(t, http.StatusBadRequest, h.raw(t, p, m.handle), p)
	}
	for _, p := range []string{"/", "/s/sbx-a", "/s/sbx-a/admin/x", "/provider/v1/chat", "/s/sbx-a/ingest/v1/other", "/metrics"} {
		require.Equal(t, http.StatusNotFound, h.raw(t, p, m.handle), p)
	}
	h.up.mu.Lock()
	require.Empty(t, h.up.got, "nothing refused reached the upstream")
	h.up.mu.Unlock()

	require.Equal(t, http.StatusForbidden, h.do(t, "GET", "/s/sbx-b/provider/x", m.handle, nil, nil).StatusCode, "sandbox X's handle under Y's URL")
	require.Equal(t, http.StatusForbidden, h.do(t, "GET", "/s/sbx-a/provider/x", other.handle, nil, nil).StatusCode)
	require.Equal(t, http.StatusOK, h.do(t, "GET", "/s/sbx-b/provider/x", other.handle, nil, nil).StatusCode)

	require.Equal(t, http.StatusUnauthorized, h.do(t, "GET", "/s/sbx-a/provider/x", "", nil, nil).StatusCode)
	require.Equal(t, http.StatusUnauthorized, h.do(t, "GET", "/s/sbx-a/provider/x", corrupt(m.handle), nil, nil).StatusCode)
	require.Equal(t, http.StatusUnauthorized, h.do(t, "GET", "/s/sbx-a/provider/x", "", http.Header{"X-Api-Key": {m.handle}}, nil).StatusCode, "bearer only")
	require.Equal(t, http.StatusUnauthorized, h.do(t, "GET", "/s/sbx-a/provider/x?access_token="+m.handle, "", nil, nil).StatusCode)

	// Denials are counted.
	resp, err := h.http.Get(h.metrics)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, reason := range []string{"bad_path", "unknown_route", "sandbox_mismatch", "missing_handle", "invalid_handle"} {
		require.Contains(t, string(body), `agentplane_credential_proxy_denials_total{reason="`+reason+`"}`)
	}
}

func TestProxyIngestMetadata(t *testing.T) {
	h := startHarness(t)
	wtm := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)
	sib, err := h.adopt(t, "sbx-a", "/w/repo", "s2", "sk-2", 100)
	require.NoError(t, err)
	require.Equal(t, wtm.handle, sib.handle, "a sibling gets the canonical handle")
	psm := h.mint(t, "sbx-a", "/w/per", "s3", "sk-3", ps, 100)
	require.True(t, strings.HasPrefix(psm.handle, "aps_"))

	batch := `{"items":[{"item_id":"m1","type":"message","version":1,"payload":{"text":"hi"}}]}`
	// Worktree handle: v2, writing the sibling's root (a live member root).
	resp := h.do(t, "POST", "/s/sbx-a/ingest/v1/sessions/rs-s2/items", sib.handle, nil, strings.NewReader(batch))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	// Per-session handle: v1, own root only.
	resp = h.do(t, "POST", "/s/sbx-a/ingest/v1/sessions/rs-s3/items", psm.handle, nil, strings.NewReader(batch))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, http.StatusForbidden, h.do(t, "POST", "/s/sbx-a/ingest/v1/sessions/rs-s1/items", psm.handle, nil, strings.NewReader(batch)).StatusCode)
	require.Equal(t, http.StatusForbidden, h.do(t, "POST", "/s/sbx-a/ingest/v1/sessions/rs-stranger/items", wtm.handle, nil, strings.NewReader(batch)).StatusCode)

	resp = h.do(t, "GET", "/s/sbx-a/ingest/v1/sessions/rs-s1/export", wtm.handle, nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var exp struct {
		Items []struct {
			ItemID  string          `json:"item_id"`
			Type    string          `json:"type"`
			Payload json.RawMessage `json:"payload"`
		} `json:"items"`
		Cursor string `json:"cursor"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&exp))
	require.Equal(t, "9-0", exp.Cursor)
	require.Equal(t, "message", exp.Items[0].Type)
	require.JSONEq(t, `{"text":"hi"}`, string(exp.Items[0].Payload))

	h.ingest.mu.Lock()
	defer h.ingest.mu.Unlock()
	require.Len(t, h.ingest.ingests, 2)
	// Each runtime session was registered once, before its first write, with
	// the member's session and the scope.
	require.Len(t, h.ingest.creates, 2)
	for i, want := range []*ingestv1.RuntimeSession{
		{RuntimeSessionId: "rs-s2", SessionId: "s2", SandboxId: "sbx-a", Directory: "/w/repo"},
		{RuntimeSessionId: "rs-s3", SessionId: "s3", SandboxId: "sbx-a", Directory: "/w/per"},
	} {
		require.True(t, proto.Equal(want, h.ingest.creates[i].GetRuntimeSession()), "registration %d: %v", i, h.ingest.creates[i].GetRuntimeSession())
	}
	v2 := h.ingest.ingests[0]
	require.Equal(t, "rs-s2", v2.GetRuntimeSessionId())
	require.Equal(t, &ingestv1.ScopeV2{SandboxId: "sbx-a", Directory: "/w/repo", ResolvingRuntimeSessionId: "rs-s1", OrgId: "org", UserId: "user"}, v2.GetScope().GetV2())
	require.Equal(t, "m1", v2.GetItems()[0].GetItemId())
	require.Equal(t, ingestv1.ItemType_ITEM_TYPE_MESSAGE, v2.GetItems()[0].GetType())
	require.JSONEq(t, `{"text":"hi"}`, string(v2.GetItems()[0].GetPayload()))
	v1 := h.ingest.ingests[1]
	require.Equal(t, "rs-s3", v1.GetScope().GetV1().GetRuntimeSessionId())
	require.Nil(t, v1.GetScope().GetV2())
	require.Equal(t, "rs-s1", h.ingest.exports[0].GetScope().GetV2().GetResolvingRuntimeSessionId())
	for _, a := range h.ingest.auth {
		require.Equal(t, "Bearer "+internalTok, a, "ingest calls carry the internal token")
	}
}

func TestGRPCReasons(t *testing.T) {
	h := startHarness(t)
	m := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)

	_, err := h.adopt(t, "sbx-a", "/w/repo", "s2", "sk-2", 200)
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, "SCOPE_HANDLE_CONFLICT", apierr.Reason(err))
	r, err := h.client.ResolveHandle(bg, &credentialv1.ResolveHandleRequest{Handle: m.handle, SandboxId: "sbx-a"})
	require.NoError(t, err)
	require.Equal(t, m.grant.GetHandleDigest(), r.GetGrant().GetHandleDigest())
	require.Len(t, r.GetGrant().GetMembers(), 1, "the surviving grant is unchanged")

	ref := h.put(t, "s3", "tok", credentialv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED)
	_, err = h.client.AdoptHandle(bg, &credentialv1.AdoptHandleRequest{
		Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"}, Member: member("s3"), CredentialRef: ref,
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED, FenceToken: 200,
	})
	require.Equal(t, "CREDENTIAL_CLASS_MIXED", apierr.Reason(err))

	_, err = h.client.MintHandle(bg, &credentialv1.MintHandleRequest{Scope: &credentialv1.Scope{Directory: "rel"}})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, "INVALID_REQUEST", apierr.Reason(err))
	fields := map[string]bool{}
	for _, v := range apierr.FieldViolations(err) {
		fields[v.GetField()] = true
	}
	for _, f := range []string{"scope.sandbox_id", "scope.directory", "member.session_id", "credential_ref", "credential_class", "fence_token"} {
		require.True(t, fields[f], f)
	}

	_, err = h.client.ResolveHandle(bg, &credentialv1.ResolveHandleRequest{Handle: "aph_nope", SandboxId: "sbx-a"})
	require.Equal(t, "HANDLE_INVALID", apierr.Reason(err))
	require.NotContains(t, err.Error(), "aph_nope")
	_, err = h.client.ResolveHandle(bg, &credentialv1.ResolveHandleRequest{Handle: m.handle, SandboxId: "sbx-b"})
	require.Equal(t, "HANDLE_SANDBOX_MISMATCH", apierr.Reason(err))

	chk, err := h.client.CheckScopeMember(bg, &credentialv1.CheckScopeMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"}, RuntimeSessionId: "rs-s1"})
	require.NoError(t, err)
	require.True(t, chk.GetLive())
	require.Equal(t, "s1", chk.GetSessionId())
	// Asked for another tenant (ingest's v2 check names the resolving
	// member's), the member is nobody the caller may reach.
	chk, err = h.client.CheckScopeMember(bg, &credentialv1.CheckScopeMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"},
		RuntimeSessionId: "rs-s1", OrgId: "evil", UserId: "user"})
	require.NoError(t, err)
	require.False(t, chk.GetLive())
	chk, err = h.client.CheckScopeMember(bg, &credentialv1.CheckScopeMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"},
		RuntimeSessionId: "rs-s1", OrgId: "org", UserId: "user"})
	require.NoError(t, err)
	require.True(t, chk.GetLive())

	rel, err := h.client.ReleaseMember(bg, &credentialv1.ReleaseMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"}, SessionId: "s1", FenceToken: 100})
	require.Equal(t, "STALE_FENCE_TOKEN", apierr.Reason(err), "fence 200 was seen for this scope")
	require.Nil(t, rel)
	rel, err = h.client.ReleaseMember(bg, &credentialv1.ReleaseMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"}, SessionId: "s1", FenceToken: 200})
	require.NoError(t, err)
	require.True(t, rel.GetScopeRetired())
	chk, err = h.client.CheckScopeMember(bg, &credentialv1.CheckScopeMemberRequest{Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"}, RuntimeSessionId: "rs-s1"})
	require.NoError(t, err)
	require.False(t, chk.GetLive())

}

// TestRevocationUnderLoad: while many clients hammer one proxy process, a
// revoking call is made on another replica (so this process's own cache
// drop cannot help); every request that starts after the call returned is
// refused, though earlier ones were served from the resolution cache.
func TestRevocationUnderLoad(t *testing.T) {
	scopeMsg := &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/repo"}
	for _, c := range []struct {
		name   string
		revoke func(other credentialv1.CredentialServiceClient, m minted) error
	}{
		{"release member", func(other credentialv1.CredentialServiceClient, _ minted) error {
			_, err := other.ReleaseMember(bg, &credentialv1.ReleaseMemberRequest{Scope: scopeMsg, SessionId: "s1", FenceToken: 100})
			return err
		}},
		{"retire scope", func(other credentialv1.CredentialServiceClient, _ minted) error {
			_, err := other.RetireScope(bg, &credentialv1.RetireScopeRequest{Scope: scopeMsg, FenceToken: 100,
				Reason: credentialv1.RetireReason_RETIRE_REASON_WRAPPER_RESTART})
			return err
		}},
		{"delete backing credential", func(other credentialv1.CredentialServiceClient, m minted) error {
			_, err := other.DeleteBackingCredential(bg, &credentialv1.DeleteBackingCredentialRequest{CredentialRef: m.ref})
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := startHarness(t)
			other := h.replica(t)
			m := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)
			revocationUnderLoad(t, h, m, func() error { return c.revoke(other, m) })
		})
	}
}

func revocationUnderLoad(t *testing.T, h *harness, m minted, revoke func() error) {
	var revoked atomic.Bool
	var before, after, afterRefused, ok200 atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				startedAfter := revoked.Load()
				req, _ := http.NewRequest("GET", h.proxyURL+"/s/sbx-a/provider/v1/models", nil)
				req.Header.Set("Authorization", "Bearer "+m.handle)
				resp, err := h.http.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if !startedAfter {
					before.Add(1)
					if resp.StatusCode == http.StatusOK {
						ok200.Add(1)
					}
					continue
				}
				after.Add(1)
				if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden {
					afterRefused.Add(1)
				} else {
					t.Errorf("request started after the revocation got %d", resp.StatusCode)
				}
			}
		})
	}
	require.Eventually(t, func() bool { return ok200.Load() > 200 }, 30*time.Second, 5*time.Millisecond)
	require.NoError(t, revoke())
	revoked.Store(true)
	require.Eventually(t, func() bool { return after.Load() > 500 }, 30*time.Second, 5*time.Millisecond)
	close(stop)
	wg.Wait()
	require.Equal(t, after.Load(), afterRefused.Load())
}

// corrupt changes one character of the checksum.
func corrupt(h string) string {
	last := byte('A')
	if h[len(h)-1] == 'A' {
		last = 'B'
	}
	return h[:len(h)-1] + string(last)
}

// The title route stores a runtime session's title as its "title" session
// item, under the same policy as items: any member root for a worktree
// handle (v2), the own root for a per-session handle (v1).
func TestProxyTitle(t *testing.T) {
	h := startHarness(t)
	wtm := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)
	_, err := h.adopt(t, "sbx-a", "/w/repo", "s2", "sk-2", 100)
	require.NoError(t, err)
	psm := h.mint(t, "sbx-a", "/w/per", "s3", "sk-3", ps, 100)
	title := func(path, handle, body string) int {
		return h.do(t, "PUT", "/s/sbx-a/ingest/v1/sessions/"+path+"/title", handle, nil, strings.NewReader(body)).StatusCode
	}

	require.Equal(t, http.StatusOK, title("rs-s2", wtm.handle, `{"title":"Fix the build","version":3}`))
	require.Equal(t, http.StatusOK, title("rs-s3", psm.handle, `{"title":"Per session","version":1}`))
	require.Equal(t, http.StatusForbidden, title("rs-s1", psm.handle, `{"title":"x","version":1}`))
	require.Equal(t, http.StatusForbidden, title("rs-stranger", wtm.handle, `{"title":"x","version":1}`))
	for _, bad := range []string{`{"title":"","version":1}`, `{"title":"x","version":0}`, `{"title":"a\nb","version":1}`,
		`{"title":"x","version":1,"extra":true}`, `not json`, `{"title":"` + strings.Repeat("x", 257) + `","version":1}`} {
		require.Equal(t, http.StatusBadRequest, title("rs-s2", wtm.handle, bad), bad)
	}
	require.Equal(t, http.StatusMethodNotAllowed, h.do(t, "GET", "/s/sbx-a/ingest/v1/sessions/rs-s2/title", wtm.handle, nil, nil).StatusCode)

	h.ingest.mu.Lock()
	defer h.ingest.mu.Unlock()
	require.Len(t, h.ingest.ingests, 2, "refused and bad requests reach ingest never")
	v2 := h.ingest.ingests[0]
	require.Equal(t, "rs-s2", v2.GetRuntimeSessionId())
	require.Equal(t, "rs-s1", v2.GetScope().GetV2().GetResolvingRuntimeSessionId())
	require.Len(t, v2.GetItems(), 1)
	it := v2.GetItems()[0]
	require.Equal(t, "title", it.GetItemId())
	require.Equal(t, ingestv1.ItemType_ITEM_TYPE_SESSION, it.GetType())
	require.Equal(t, uint64(3), it.GetVersion())
	require.JSONEq(t, `{"title":"Fix the build"}`, string(it.GetPayload()))
	require.Equal(t, "rs-s3", h.ingest.ingests[1].GetScope().GetV1().GetRuntimeSessionId())
}

// A proxied request whose handle resolution finds Redis down (a failover:
// the node refuses connections) retries within PROXY_RESOLVE_BUDGET and
// succeeds once Redis is back, instead of failing the runtime's request.
func TestProxyRetriesResolutionWhileRedisIsDown(t *testing.T) {
	h := startHarness(t)
	m := h.mint(t, "sbx-fo", "/w/fo", "s1", "sk-failover-secret", wt, 100)
	require.NoError(t, h.rdb.Client(t).Save(bg).Err()) // the restart below loads it
	require.NoError(t, h.rdb.Kill())

	type result struct {
		code int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		req, err := http.NewRequest("POST", h.proxyURL+"/s/sbx-fo/provider/v1/chat/completions", strings.NewReader(`{"model":"m"}`))
		if err != nil {
			done <- result{err: err}
			return
		}
		req.Header.Set("Authorization", "Bearer "+m.handle)
		resp, err := h.http.Do(req)
		if err != nil {
			done <- result{err: err}
			return
		}
		_ = resp.Body.Close()
		done <- result{code: resp.StatusCode}
	}()
	// The request waits (it has not answered 503) while Redis is down.
	require.Eventually(t, func() bool {
		resp, err := h.http.Get(h.metrics)
		if err != nil {
			return false
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		return regexp.MustCompile(`(?m)^agentplane_credential_proxy_resolve_retries_total [1-9]`).Match(body)
	}, 30*time.Second, 20*time.Millisecond)
	select {
	case r := <-done:
		t.Fatalf("the request ended while Redis was down: %+v", r)
	default:
	}
	h.rdb.Start(t)
	r := <-done
	require.NoError(t, r.err)
	require.Equal(t, http.StatusOK, r.code)
	require.Equal(t, []string{"Bearer sk-failover-secret"}, h.up.last().Header.Values("Authorization"))
}
