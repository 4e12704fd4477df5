package main

import (
	"context"
	"errors"
	"flag"
	"io"
	"net/http"
	"os"
	"time"
)

// chatResponse is a small OpenAI chat completion, the size of a short answer.
const chatResponse = `{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",` +
	`"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],` +
	`"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`

// runUpstream serves POST /v1/chat/completions: it reads the request body and
// answers 200 only to "Authorization: Bearer <backing secret>" (so a proxied
// call proves the handle was swapped for the backing credential).
func runUpstream(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("proxybench upstream", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:0", "listen address")
	if err := fs.Parse(args); err != nil {
		return err
	}
	want := "Bearer " + os.Getenv(secretEnv)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.Header.Get("Authorization") != want {
			http.Error(w, `{"error":{"message":"bad key"}}`, http.StatusUnauthorized)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, chatResponse)
	})
	srv := &http.Server{Addr: *addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
