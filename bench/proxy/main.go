// Command proxybench measures the credential proxy the way it is deployed:
// a private redis-server, a local OpenAI-like upstream, the credential
// service binary and a load generator each run as their own process. The
// load generator mints a handle over the CredentialService gRPC API (as the
// sandbox service does) and measures, in one run and in interleaved rounds,
// the Redis PING round trip, direct calls to the upstream and the same calls
// through the proxy: latency with the Go net/http client one request at a
// time, throughput with wrk (or the Go client, -generator go), the same
// generator for direct and proxied calls. bench/proxy/run.sh builds and
// runs it.
//
//	proxybench -credential-bin PATH [-rounds 5] [-generator auto] [-credential-gomaxprocs 0] [-pin credential=1,redis=0,upstream=0,load=0]
//	proxybench upstream -addr HOST:PORT   (child process)
//	proxybench load ...                   (child process)
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	var err error
	switch {
	case len(os.Args) > 1 && os.Args[1] == "upstream":
		err = runUpstream(ctx, os.Args[2:])
	case len(os.Args) > 1 && os.Args[1] == "load":
		err = runLoad(ctx, os.Args[2:], os.Stdout)
	default:
		err = runAll(ctx, os.Args[1:], os.Stdout, os.Stderr)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "proxybench:", err)
		os.Exit(1)
	}
}
