# agentplane: one Makefile with the canonical targets.
#   make dev        start the whole suite on this machine (agentplane dev)
#   make test       every module's tests against private redis-servers, the chart checks, and
#                   the chart on the test cluster (built cold on first use: see make cluster)
#   make test-redis-topologies  the store and fence suites on a real Redis Cluster and Sentinel
#                   (test-redis-stores), and the services through a failover (test-redis-failover)
#   make generate   regenerate pkg/gen from proto/ with the pinned local plugins
#   make lint       buf lint + format + breaking, go vet, golangci-lint
#   make bench      benchmarks side by side with their references (see docs/benchmarks.md)
#   make helm-check render and strictly decode the Helm chart, strict lint, the profiles
#   make cluster    build (or reuse) the test cluster's binaries (deploy/cluster/build.sh;
#                   ~15-30 min cold on 2 cores, seconds when cached: docs/development.md)
#   make test-cluster  build (or reuse) it and run the chart on it (install/upgrade/uninstall,
#                   PodSecurity, namespace admin, helm template); part of `make test` (beside test-go)

SHELL := /bin/bash
comma := ,
BIN   := $(CURDIR)/.cache/bin
BUF   := $(BIN)/buf
# Modules of go.work; `go list ./...` does not work at a workspace root.
MODULES = $(shell go list -m -f '{{.Dir}}')
GOTEST_FLAGS ?= -race -count=1 -timeout 30m

.PHONY: agents all tools generate check-generated lint proto-lint vet golangci test test-go test-redis-topologies test-redis-stores test-redis-failover bench helm-check cluster test-cluster dev build clean

all: lint test

# Tools are pinned in tools/go.mod and built once into .cache/bin (offline after the first download).
TOOL_BINS = $(BUF) $(BIN)/benchstat $(BIN)/golangci-lint
tools: $(TOOL_BINS)
$(TOOL_BINS) &: tools/go.mod tools/go.sum
	@mkdir -p $(BIN)
	GOWORK=off go -C tools build -o $(BIN)/ github.com/bufbuild/buf/cmd/buf golang.org/x/perf/cmd/benchstat \
	  github.com/golangci/golangci-lint/v2/cmd/golangci-lint
	@touch $(TOOL_BINS)

generate: $(BUF)
	rm -rf pkg/gen
	$(BUF) generate

# Fails when the committed generated code differs from what the pinned plugins produce.
check-generated: generate
	@git diff --exit-code --stat -- pkg/gen && test -z "$$(git status --porcelain -- pkg/gen)" \
	  || { echo "pkg/gen is out of date: run make generate and commit"; exit 1; }

proto-lint: $(BUF)
	$(BUF) lint
	$(BUF) format -d --exit-code
	$(BUF) breaking --against proto/baseline.binpb

# The loops below run every module whatever fails before it, and end with
# the list of what failed (non-zero exit when anything did): one flaky
# module must not hide the others' results. Each step ends with a line
# saying how long it took (`== go test X (took N s)`, FAILED when it did),
# so every run shows where the time goes.
FAILED_REPORT = if [ -n "$$failed" ]; then echo; echo "FAILED:$$failed"; exit 1; fi
# $(call TIMED,label,command,failure name): runs command, prints its time.
TIMED = echo "== $(1)"; t0=$$SECONDS; if ( $(2) ); then r=""; else r=" FAILED"; failed="$$failed $(3)"; fi; \
  echo "== $(1)$$r (took $$((SECONDS - t0)) s)"

# go vet alone; `make lint` does not run it: golangci-lint's standard set
# includes govet (the same default analyzers), and running both type-checked
# every module twice.
vet:
	@failed=""; for m in $(MODULES); do $(call TIMED,go vet $$m,cd $$m && go vet ./...,$$m); done; \
	  $(FAILED_REPORT)

golangci: $(BIN)/golangci-lint
	@failed=""; for m in $(MODULES) $(CURDIR)/deploy/helm; do \
	  if [ "$$m" = "$(CURDIR)/deploy/helm" ]; then g=off; else g=; fi; \
	  $(call TIMED,golangci-lint $$m,cd $$m && GOWORK=$$g $(BIN)/golangci-lint run --allow-parallel-runners ./...,$$m); done; \
	  $(FAILED_REPORT)

lint: proto-lint golangci

# The e2e module (cmd/agentplane, the long pole: its e2e package runs ~1,300 s of tests one
# after another, mostly waiting on agents and timers, at a load near 1) runs in the background
# beside the other modules, which run one after another, in two shards: E2E_SHARD (its longest
# tests, ~700 s) and the rest of the module. A test is in exactly one shard whatever the list
# names (-run and -skip of one pattern). Their output is printed after the other modules'.
E2E_MODULE = $(CURDIR)/cmd/agentplane
E2E_SHARD = ^(TestChartShapedTenantsOpenCode|TestChurnSoak|TestNothingOutlivesItsOpencodeSessions|TestSentinelFailoverAcks|TestSandboxKilledWhileSuspending|TestChartShapedTenants)$$
test-go:
	@failed=""; alog=$$(mktemp); blog=$$(mktemp); \
	  ( cd $(E2E_MODULE) && go test $(GOTEST_FLAGS) -run '^$$' ./e2e/ >/dev/null 2>&1; \
	    ( failed=""; $(call TIMED,go test $(E2E_MODULE) ./e2e/ -run '$(E2E_SHARD)',go test $(GOTEST_FLAGS) -run '$(E2E_SHARD)' ./e2e/,e2e-shard); \
	      $(FAILED_REPORT) ) >$$alog 2>&1 & apid=$$!; \
	    ( failed=""; $(call TIMED,go test $(E2E_MODULE) ./... -skip '$(E2E_SHARD)',go test $(GOTEST_FLAGS) -skip '$(E2E_SHARD)' ./...,rest); \
	      $(FAILED_REPORT) ) >$$blog 2>&1; b=$$?; wait $$apid; a=$$?; \
	    [ $$a -eq 0 ] && [ $$b -eq 0 ] ) & epid=$$!; \
	  for m in $(filter-out $(E2E_MODULE),$(MODULES)); do $(call TIMED,go test $$m,cd $$m && go test $(GOTEST_FLAGS) ./...,$$m); done; \
	  wait $$epid || failed="$$failed $(E2E_MODULE)"; \
	  echo "== go test $(E2E_MODULE), in two shards: output"; cat $$alog $$blog; rm -f $$alog $$blog; \
	  $(FAILED_REPORT)

# Each part runs even when an earlier one failed (make -k would also run them; this
# keeps plain `make test` reporting all of them). test-cluster runs beside the others: it
# waits for the cluster's build (niced; CI starts it first, .ci/run) and then mostly waits
# on the cluster (~125 CPU-s in ~7 min), so it costs the other parts little; its output is
# printed after theirs.
test:
	@failed=""; clog=$$(mktemp); \
	  echo "== test-cluster runs in the background; its output follows the other parts'"; \
	  ( $(MAKE) --no-print-directory test-cluster >$$clog 2>&1 ) & cpid=$$!; \
	  $(MAKE) --no-print-directory test-go || failed="$$failed test-go"; \
	  $(MAKE) --no-print-directory helm-check || failed="$$failed helm-check"; \
	  wait $$cpid || failed="$$failed test-cluster"; \
	  echo "== test-cluster output"; cat $$clog; rm -f $$clog; \
	  $(FAILED_REPORT)

# The test cluster's binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kwok, helm) built from the Go module proxy at the versions pinned by deploy/cluster/go.mod
# into a cache outside the repository (${XDG_CACHE_HOME:-~/.cache}/agentplane/cluster/<version>);
# reused when built (docs/development.md "The test cluster": cold and warm times).
cluster:
	bash deploy/cluster/build.sh

# The store and fence suites again on a real Redis Cluster (3 masters + 3 replicas) and a real
# Sentinel group (pkg/redistest; `make test` runs them on one redis-server), and the failover
# e2e tests: real services on a Sentinel group / Cluster while its master fails over (they are
# e2e tests, so `make test` runs them too). CI runs test-redis-stores beside `make test` (.ci/run).
REDIS_TOPOLOGY_SUITES = pkg:./fence/ services/credential:./internal/store/ services/ingest:./internal/store/ \
  services/session:./internal/store/ services/sandbox:./internal/control/store/,./internal/control/ownership/,./internal/control/leasestore/
REDIS_FAILOVER_E2E = ^(TestSentinelFailover(Acks|KeepsSandboxes)|TestClusterFailoverKill)$$
test-redis-topologies: test-redis-stores test-redis-failover
test-redis-stores:
	@failed=""; for topo in cluster sentinel; do for s in $(REDIS_TOPOLOGY_SUITES); do \
	  m=$${s%%:*}; p=$${s#*:}; \
	  $(call TIMED,AGENTPLANE_TEST_REDIS=$$topo go test $$m $${p//$(comma)/ },cd $$m && AGENTPLANE_TEST_REDIS=$$topo go test $(GOTEST_FLAGS) $${p//$(comma)/ },$$topo:$$s); \
	  done; done; \
	  $(FAILED_REPORT)
test-redis-failover:
	@failed=""; $(call TIMED,go test cmd/agentplane ./e2e/ -run '$(REDIS_FAILOVER_E2E)',cd cmd/agentplane && go test -count=1 -timeout 10m -run '$(REDIS_FAILOVER_E2E)' ./e2e/,failover-e2e); \
	  $(FAILED_REPORT)

helm-check:
	bash deploy/helm/check.sh

# The chart on the test cluster (required: a missing cluster fails).
CLUSTER_TESTS = ^(TestChartOnCluster|TestChartByNamespaceAdmin|TestPodSecurityLevels|TestHelmTemplateAsDocumented)$$
test-cluster:
	@failed=""; $(call TIMED,build (or reuse) the test cluster,bash deploy/cluster/build.sh,cluster-build); \
	  $(call TIMED,go test deploy/helm -run '$(CLUSTER_TESTS)',cd deploy/helm && GOWORK=off AGENTPLANE_TEST_CLUSTER=required go test -count=1 -timeout 30m -run '$(CLUSTER_TESTS)' .,cluster-tests); \
	  $(FAILED_REPORT)

bench: tools
	bash bench/run.sh

# The coding agents the ACP runtimes and their tests use, pinned by
# agents/package-lock.json (opencode-ai, @kilocode/cli). The services find
# them through AGENTPLANE_AGENTS_DIR (the e2e tests default to agents/).
agents:
	cd agents && npm ci --no-audit --no-fund
	agents/node_modules/opencode-linux-x64/bin/opencode --version
	agents/node_modules/@kilocode/cli-linux-x64/bin/kilo --version

# --version's commit: a go.work build records none in the build information.
COMMIT = $(shell c=$$(git rev-parse --short=12 HEAD 2>/dev/null) && { git diff --quiet HEAD || c=$$c+modified; } && echo $$c)

build:
	@mkdir -p bin
	go build -ldflags "-X main.commit=$(COMMIT)" -o bin/agentplane ./cmd/agentplane

dev: build
	./bin/agentplane dev

clean:
	rm -rf bin .cache
