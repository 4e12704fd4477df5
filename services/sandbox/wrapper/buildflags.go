package wrapper

// BuildFlags are the `go build` flags of the agentplane-wrapper binary, as
// the image builds it (Dockerfile; TestImageBuildsTheWrapperWithBuildFlags)
// and as `agentplane dev` and the e2e suite build it. Every sandbox maps the
// binary, and its PSS beside the agent is mostly the binary's pages
// (docs/benchmarks.md "agentplane's share of a live sandbox"):
// grpcnotrace leaves out grpc's golang.org/x/net/trace and the templates it
// links (4.3 MB of 22.8), -s -w the symbol tables.
var BuildFlags = []string{"-tags", "grpcnotrace", "-ldflags", "-s -w"}
