package worktree

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"
)

// relay is a loopback HTTP server that lives for one git command. It
// forwards only requests for the route's repository to the proxy and adds
// the route's handle as the bearer, so git itself holds no secret: not in
// its argv, environment, config or a credential helper's files. While it
// runs, any process of the sandbox could use it, but only for what the
// handle (which the runtime holds anyway) already allows: this one
// repository through the proxy.
type relay struct {
	srv  *http.Server
	ln   net.Listener
	base string // http://127.0.0.1:<port>
}

// startRelay serves the relay for repo under proxyURL; handle is asked per
// request so a rotation applies at once.
func startRelay(proxyURL string, repo Repo, handle func() string) (*relay, error) {
	target, err := url.Parse(strings.TrimRight(proxyURL, "/"))
	if err != nil || (target.Scheme != "http" && target.Scheme != "https") || target.Host == "" {
		return nil, errors.New("worktree: bad proxy URL")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	prefix := repo.ProxyPath() + "/"
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = target.Host
			pr.Out.Header.Del("Authorization")
			pr.Out.Header.Set("Authorization", "Bearer "+handle())
		},
		FlushInterval: -1,
		ErrorLog:      nil,
	}
	mux := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.EscapedPath(), prefix) {
			http.Error(w, "not this repository", http.StatusForbidden)
			return
		}
		rp.ServeHTTP(w, r)
	})
	rl := &relay{
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 30 * time.Second},
		ln:  ln, base: "http://" + ln.Addr().String(),
	}
	go func() { _ = rl.srv.Serve(ln) }()
	return rl, nil
}

// url is the repository through the relay.
func (rl *relay) url(repo Repo) string { return rl.base + repo.ProxyPath() }

func (rl *relay) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = rl.srv.Shutdown(ctx)
	_ = rl.srv.Close()
}
