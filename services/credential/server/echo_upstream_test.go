package server

import (
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
)

// echo answers the upstream paths ending in an echo operation, as an
// upstream that reflects requests does (RFC 9110 TRACE, a debug endpoint,
// an error quoting the request), and reports whether it did:
//
//	.../echo          the request (method, target, headers, body) as the body
//	.../echo-chunked  the same in 5-byte chunks, flushed one by one
//	.../echo-headers  every request header as an Echo-<name> response header
//	.../echo-gzip     the request as the body, labelled Content-Encoding: gzip
//	.../many-headers  300 response headers
//	.../big-header    one 100 KiB response header
func echo(w http.ResponseWriter, r *http.Request) bool {
	op := r.URL.Path[strings.LastIndex(r.URL.Path, "/")+1:]
	switch op {
	case "echo", "echo-chunked", "echo-gzip":
		msg := echoed(r)
		w.Header().Set("Content-Type", "message/http")
		if op == "echo-gzip" {
			w.Header().Set("Content-Encoding", "gzip")
		}
		if op != "echo-chunked" {
			_, _ = io.WriteString(w, msg)
			return true
		}
		for len(msg) > 0 {
			n := min(5, len(msg))
			_, _ = io.WriteString(w, msg[:n])
			w.(http.Flusher).Flush()
			msg = msg[n:]
		}
	case "echo-headers":
		for k, vs := range r.Header {
			for _, v := range vs {
				w.Header().Add("Echo-"+k, v)
			}
		}
		w.WriteHeader(http.StatusOK)
	case "many-headers":
		for i := range 300 {
			w.Header().Set(fmt.Sprintf("X-Many-%d", i), "v")
		}
		w.WriteHeader(http.StatusOK)
	case "big-header":
		w.Header().Set("X-Big", strings.Repeat("b", 100<<10))
		w.WriteHeader(http.StatusOK)
	default:
		return false
	}
	return true
}

// echoed is r as a TRACE answer carries it.
func echoed(r *http.Request) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\n", r.Method, r.URL.RequestURI())
	names := make([]string, 0, len(r.Header))
	for k := range r.Header {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		for _, v := range r.Header[k] {
			fmt.Fprintf(&b, "%s: %s\r\n", k, v)
		}
	}
	b.WriteString("\r\n")
	body, _ := io.ReadAll(r.Body)
	b.Write(body)
	return b.String()
}
