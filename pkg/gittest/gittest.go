// Package gittest runs a real git smart-HTTP server for tests: git's own
// `git http-backend` (CGI) behind a Go HTTP server that requires a token as
// the Basic password, with fetch and push enabled, and a log of every
// request it answered.
package gittest

import (
	"encoding/base64"
	"net/http"
	"net/http/cgi"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// Request is one logged request.
type Request struct {
	Method, Path, Query string
	RemoteAddr          string
	UserAgent           string
	Authorized          bool // the Basic password was the token
	CarriedToken        bool // the token appeared anywhere in the request head
	Status              int
}

// Server is a git smart-HTTP server over repositories under Root.
type Server struct {
	URL   string // http://127.0.0.1:<port>
	Root  string
	Token string

	mu     sync.Mutex
	log    []Request
	public map[string]bool // repository names served without authentication
	srv    *httptest.Server
}

// MakePublic serves the repository name (as given to CreateRepo) to anyone,
// without authentication, as a public repository on a forge is.
func (s *Server) MakePublic(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.public == nil {
		s.public = map[string]bool{}
	}
	s.public[name] = true
}

func (s *Server) isPublic(path string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name := range s.public {
		if strings.HasPrefix(path, "/"+name+"/") {
			return true
		}
	}
	return false
}

// Start runs a server that admits requests whose Basic password is token.
func Start(t testing.TB, token string) *Server {
	t.Helper()
	gitPath, err := exec.LookPath("git")
	if err != nil {
		t.Fatalf("gittest: git not found: %v", err)
	}
	execPath, err := exec.Command(gitPath, "--exec-path").Output()
	if err != nil {
		t.Fatalf("gittest: git --exec-path: %v", err)
	}
	s := &Server{Root: t.TempDir(), Token: token}
	backend := &cgi.Handler{
		Path: filepath.Join(strings.TrimSpace(string(execPath)), "git-http-backend"),
		Env:  []string{"GIT_PROJECT_ROOT=" + s.Root, "GIT_HTTP_EXPORT_ALL=1", "REMOTE_USER=gittest"},
	}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := Request{Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, RemoteAddr: r.RemoteAddr, UserAgent: r.UserAgent()}
		for k, vs := range r.Header {
			for _, v := range vs {
				if strings.Contains(k+v, token) || strings.Contains(decodeBasic(v), token) {
					rec.CarriedToken = true
				}
			}
		}
		if strings.Contains(r.URL.String(), token) {
			rec.CarriedToken = true
		}
		_, pass, ok := r.BasicAuth()
		rec.Authorized = ok && pass == token
		sw := &statusWriter{ResponseWriter: w, code: 200}
		if !rec.Authorized && !s.isPublic(r.URL.Path) {
			sw.Header().Set("WWW-Authenticate", `Basic realm="gittest"`)
			http.Error(sw, "authentication required", http.StatusUnauthorized)
		} else {
			backend.ServeHTTP(sw, r)
		}
		rec.Status = sw.code
		s.mu.Lock()
		s.log = append(s.log, rec)
		s.mu.Unlock()
	}))
	t.Cleanup(s.srv.Close)
	s.URL = s.srv.URL
	return s
}

func decodeBasic(v string) string {
	scheme, rest, ok := strings.Cut(v, " ")
	if !ok || !strings.EqualFold(scheme, "basic") {
		return ""
	}
	b, _ := base64.StdEncoding.DecodeString(strings.TrimSpace(rest))
	return string(b)
}

type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(c int) { w.code = c; w.ResponseWriter.WriteHeader(c) }
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Log returns the requests answered so far.
func (s *Server) Log() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.log...)
}

// RepoURL is the HTTP URL of repository name ("org/repo.git").
func (s *Server) RepoURL(name string) string { return s.URL + "/" + name }

// CreateRepo makes a bare repository name with one commit on main holding
// files, and returns its directory. Pushes are enabled.
func (s *Server) CreateRepo(t testing.TB, name string, files map[string]string) string {
	t.Helper()
	bare := filepath.Join(s.Root, name)
	work := t.TempDir()
	for p, c := range files {
		full := filepath.Join(work, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	Run(t, work, "init", "-q", "-b", "main")
	Run(t, work, "add", "-A")
	Run(t, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "initial")
	Run(t, "", "clone", "-q", "--bare", work, bare)
	Run(t, bare, "config", "http.receivepack", "true")
	Run(t, bare, "config", "uploadpack.allowAnySHA1InWant", "true")
	return bare
}

// Run runs git in dir (fatal on failure) and returns its output.
func Run(t testing.TB, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_TERMINAL_PROMPT=0", "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// AuthURL is repository name's URL with the token as Basic password (for
// the test's own direct clone).
func (s *Server) AuthURL(name string) string {
	return strings.Replace(s.URL, "http://", "http://x:"+s.Token+"@", 1) + "/" + name
}
