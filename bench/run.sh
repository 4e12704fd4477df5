#!/usr/bin/env bash
# Runs every benchmark of agentplane side by side with its reference, in one
# go test run per package (so each comparison shares one machine state), and
# prints benchstat tables. Results and their reading live in docs/benchmarks.md.
#   bash bench/run.sh            all
#   bash bench/run.sh fence      one of: fence proxy proxy-processes ingest session acp tenancy
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${BENCH_OUT:-$root/.cache/bench}
count=${BENCH_COUNT:-6}
benchstat=$root/.cache/bin/benchstat
mkdir -p "$out"

run() { # name dir package pattern benchtime
  local name=$1 dir=$2 pkg=$3 pattern=$4 benchtime=$5
  echo "== $name ($dir: go test $pkg -bench '$pattern' -count $count -benchtime $benchtime)"
  (cd "$dir" && go test "$pkg" -run '^$' -bench "$pattern" -count "$count" -benchtime "$benchtime") | tee "$out/$name.txt"
  "$benchstat" "$out/$name.txt"
}

want=${1:-all}
[[ $want == all || $want == fence ]] && run fence pkg ./fence/ 'Fence/conc=[0-9]+/interleaved' 8000x
[[ $want == all || $want == proxy ]] && run proxy services/credential ./server BenchmarkProxy 3000x
# The proxy as deployed: redis-server, upstream, credential binary and load
# generator as separate processes (bench/proxy/run.sh; its own table).
[[ $want == all || $want == proxy-processes ]] && bash "$root/bench/proxy/run.sh"
[[ $want == all || $want == ingest ]] && run ingest services/ingest ./internal/grpcapi BenchmarkIngest1KiB 1500x
[[ $want == all || $want == session ]] && run session services/session ./server WarmSendToAccepted 3s
# Cold first event with the sandbox boundary and without it, alternating (docs/benchmarks.md).
[[ $want == all || $want == session ]] && run session-cold cmd/agentplane ./e2e '^BenchmarkColdFirstEvent$' 40x
# Real agents over ACP (issue 17): needs make agents; few iterations, agents are heavy.
[[ $want == all || $want == acp ]] && run acp cmd/agentplane ./e2e 'ACPUpdateToWatcher|OpenCodeColdFirstEvent' 5x
# Limits per sandbox on vs off, and a hostile tenant's flood, request head and hogs against
# the sandbox service and another tenant (issue 31); chart-shaped, needs root, bwrap, setpriv, perl.
[[ $want == all || $want == tenancy ]] && run tenancy cmd/agentplane ./e2e '^BenchmarkTenancy' 20x
echo "raw results in $out"
