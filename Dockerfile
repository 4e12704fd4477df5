# syntax=docker/dockerfile:1
#
# agentplane container image: ONE image holding the all-in-one `agentplane` binary
# (module cmd/agentplane) and `agentplane-wrapper` (services/sandbox/cmd/agentplane-wrapper).
# Each workload of the Helm chart runs one subcommand: `agentplane serve session|sandbox|credential|ingest`.
#
# Why one image and not one per service:
#   - the four services share the same base, the same dependencies and the same pkg/ code, so
#     one build produces one static binary and one image to scan, sign and roll out; a version
#     skew between services of one release cannot happen;
#   - the sandbox service's process provider launches `agentplane-wrapper wrapper` (and the
#     built-in `agentplane-wrapper runtime scripted`) as child processes, so the wrapper must ship
#     next to the sandbox service anyway (AGENTPLANE_WRAPPER_BIN=/usr/local/bin/agentplane-wrapper).
#     It is its own, smaller binary because every cold session starts it: a Go process runs the
#     initialisers of everything linked in before main (all four services: ~37 ms here; the
#     wrapper alone: ~21 ms). `agentplane wrapper` works too;
#   - the binary is static (CGO_ENABLED=0) and small, so the unused subcommands cost little.
#
# The image is not built in CI (no container engine runs there); `make helm-check` verifies
# the chart only. Build it with:
#   docker build -t agentplane/agentplane:dev .
#   docker build --build-arg VERSION=0.1.0 -t agentplane/agentplane:0.1.0 .

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
# Use exactly the Go of the image; never download another toolchain during the build.
ENV CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-trimpath
# The whole workspace: go.work ties pkg/, services/* and cmd/agentplane together
# (.dockerignore keeps .git, deploy/, the pinned tools' go.mod and build output out of the context).
COPY . .
ARG VERSION=dev
RUN --mount=type=cache,target=/root/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    go build -ldflags "-s -w -X main.version=${VERSION}" -o /out/agentplane ./cmd/agentplane \
 && go build -tags grpcnotrace -ldflags "-s -w" -o /out/agentplane-wrapper ./services/sandbox/cmd/agentplane-wrapper \
 && mkdir -p /out/sandboxes

# bubblewrap puts every sandbox behind its boundary (docs/sandbox.md, "The boundary"); it is
# dynamically linked, so the runtime image is distroless base (glibc) with bwrap and its two
# libraries copied from Debian's package.
FROM debian:bookworm-slim AS bwrap
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap \
 && mkdir -p /out/lib && cp /usr/bin/bwrap /out/ \
 && cp -L $(ldd /usr/bin/bwrap | awk '/=> \// {print $3}' | grep -E 'libcap|libselinux|libpcre2') /out/lib/

# distroless base: no shell, no package manager; glibc, CA certificates and /etc/passwd;
# the :nonroot tag runs as uid/gid 65532.
FROM gcr.io/distroless/base-debian12:nonroot
COPY --from=bwrap /out/bwrap /usr/bin/bwrap
COPY --from=bwrap /out/lib/ /usr/lib/x86_64-linux-gnu/
COPY --from=build /out/agentplane /out/agentplane-wrapper /usr/local/bin/
# Default sandbox root of the process provider (the chart mounts a volume here).
COPY --from=build --chown=65532:65532 /out/sandboxes /var/lib/agentplane/sandboxes
USER 65532:65532
ENV AGENTPLANE_SANDBOX_ROOT=/var/lib/agentplane/sandboxes \
    AGENTPLANE_WRAPPER_BIN=/usr/local/bin/agentplane-wrapper
# gRPC: session 7401, sandbox 7402, credential 7403, ingest 7404; credential proxy (HTTP) 7405;
# /metrics 9401..9404 (the same numbers as `agentplane dev`, see docs/development.md).
EXPOSE 7401 7402 7403 7404 7405 9401 9402 9403 9404
ENTRYPOINT ["/usr/local/bin/agentplane"]
CMD ["--help"]
