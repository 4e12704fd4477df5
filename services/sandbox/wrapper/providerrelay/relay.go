// Package providerrelay is the wrapper's provider relay: an HTTP server on the
// sandbox's loopback that an agent uses as its OpenAI-compatible base URL.
// It forwards each request to `<proxy_url>/provider/...` and sets
// `Authorization: Bearer <handle>` itself, with the handle current when the
// request starts. So the handle never enters the agent's environment, argv
// or files (its config names the relay and a dummy key), and a rotated
// handle applies to the agent's next request without restarting it.
//
// The relay reaches nothing but the route's proxy_url, which inside the
// sandbox boundary is itself an address on the sandbox loopback.
package providerrelay

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// DummyKey is the API key written into agent configs; the relay drops
// whatever Authorization the agent sends.
const DummyKey = "agentplane-relay"

// Relay is the running relay.
type Relay struct {
	ln     net.Listener
	srv    *http.Server
	client *http.Client

	mu          sync.RWMutex
	proxy       *url.URL
	handle      string
	traceparent string // the running turn's; see SetTraceparent
}

// Start listens on 127.0.0.1 (an ephemeral port) and serves.
func Start() (*Relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &Relay{ln: ln, client: &http.Client{
		// Streamed completions run as long as the model talks; the agent's
		// own timeouts and cancellation bound them.
		Transport:     &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 8, IdleConnTimeout: 90 * time.Second, ResponseHeaderTimeout: 5 * time.Minute},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}
	r.srv = &http.Server{Handler: r, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = r.srv.Serve(ln) }()
	return r, nil
}

// BaseURL is the OpenAI-compatible base an agent is configured with.
func (r *Relay) BaseURL() string { return "http://" + r.ln.Addr().String() + "/v1" }

// Set records the proxy base (PrepareRoute's proxy_url) and the current
// handle; an empty value leaves that part unchanged.
func (r *Relay) Set(proxyURL, handle string) error {
	var u *url.URL
	if proxyURL != "" {
		p, err := url.Parse(strings.TrimRight(proxyURL, "/"))
		if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
			return errors.New("relay: bad proxy url")
		}
		u = p
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if u != nil {
		r.proxy = u
	}
	if handle != "" {
		r.handle = handle
	}
	return nil
}

// SetTraceparent records the W3C trace context of the turn that starts
// (empty: none runs), so the agent's model requests, which carry none of
// their own, join the turn's trace at the proxy. One agent process may run
// turns of several routes at once; a request then carries the trace of the
// turn that started last.
func (r *Relay) SetTraceparent(tp string) {
	r.mu.Lock()
	r.traceparent = tp
	r.mu.Unlock()
}

// Close stops the relay.
func (r *Relay) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return r.srv.Shutdown(ctx)
}

// hopHeaders are not forwarded (RFC 9110 7.6.1), nor are credentials the
// agent sent (the dummy key).
var dropHeaders = []string{"Authorization", "Proxy-Authorization", "Cookie", "Connection", "Keep-Alive",
	"Proxy-Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "X-Api-Key", "Api-Key"}

func (r *Relay) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r.mu.RLock()
	proxy, handle, tp := r.proxy, r.handle, r.traceparent
	r.mu.RUnlock()
	if proxy == nil || handle == "" {
		http.Error(w, `{"error":{"message":"agentplane relay: no route is open yet"}}`, http.StatusServiceUnavailable)
		return
	}
	target := *proxy
	target.Path = proxy.Path + "/provider" + req.URL.Path
	target.RawQuery = req.URL.RawQuery
	out, err := http.NewRequestWithContext(req.Context(), req.Method, target.String(), req.Body)
	if err != nil {
		http.Error(w, `{"error":{"message":"agentplane relay: bad request"}}`, http.StatusBadRequest)
		return
	}
	out.ContentLength = req.ContentLength
	for k, vs := range req.Header {
		out.Header[k] = vs
	}
	for _, h := range dropHeaders {
		out.Header.Del(h)
	}
	out.Header.Set("Authorization", "Bearer "+handle)
	if tp != "" && out.Header.Get("Traceparent") == "" {
		out.Header.Set("Traceparent", tp)
	}
	resp, err := r.client.Do(out)
	if err != nil {
		http.Error(w, `{"error":{"message":"agentplane relay: proxy unreachable"}}`, http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	flusher, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			if flusher != nil {
				flusher.Flush() // streamed completions reach the agent chunk by chunk
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				return
			}
			return
		}
	}
}

// Target returns the proxy base and the current handle (for the wrapper's
// own calls through the proxy, such as history).
func (r *Relay) Target() (proxyURL, handle string) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.proxy == nil {
		return "", r.handle
	}
	return r.proxy.String(), r.handle
}
