#!/usr/bin/env bash
# Credential proxy benchmark as deployed: redis-server, an OpenAI-like
# upstream, the credential service binary and a load generator run as
# separate processes (the proxybench command beside this script). One run reports,
# per round and as the median over rounds: Redis PING RTT, direct and proxied
# p50/p99 at concurrency 1 (interleaved request by request), req/s at
# -conc keep-alive connections, and the credential process's CPU per request.
#   bash bench/proxy/run.sh                      unpinned
#   bash bench/proxy/run.sh -pin credential=1,redis=0,upstream=0,load=0
# Extra flags go to proxybench (-rounds, -samples, -conc, -duration,
# -generator wrk|go|auto for the throughput phase — wrk when installed,
# `apt-get install -y wrk` —, -credential-gomaxprocs N).
# REF_CREDENTIAL_BIN=/path/to/older/credential runs that binary's proxy too,
# in the same rounds, as the reference.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${BENCH_BIN:-$PWD/.cache/bench/bin}
mkdir -p "$bin"
(cd services/credential && go build -o "$bin/credential" ./cmd/credential)
(cd bench && go build -o "$bin/proxybench" ./proxy)
exec "$bin/proxybench" -credential-bin "${REF_CREDENTIAL_BIN:+$REF_CREDENTIAL_BIN,}$bin/credential" "$@"
