package grpcapi_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/ingest/internal/grpcapi"
	"agentplane.dev/services/ingest/internal/membership"
	"agentplane.dev/services/ingest/internal/store"
)

const (
	benchBatch   = 128  // items per batch, the service's limit
	benchStreams = 4    // concurrent IngestStreams / raw pipelines
	benchPayload = 1024 // bytes of JSON per item
)

// BenchmarkIngest1KiB measures items/s of 1 KiB items stored over gRPC (IngestStream, batches
// of 128, several concurrent streams, a real TCP listener and the full grpcserver chain)
// against its reference in the same run: raw pipelined XADD of the same payloads, 128 per
// round trip, from as many goroutines, to the same private redis-server. One op is one
// batch of 128 items; the items/s metric is what docs/benchmarks.md records.
func BenchmarkIngest1KiB(b *testing.B) {
	redisSrv := redistest.Start(b)
	rdb := redisSrv.Client(b)
	payload := []byte(`{"text":"` + strings.Repeat("x", benchPayload-11) + `"}`)
	if len(payload) != benchPayload {
		b.Fatalf("payload is %d bytes", len(payload))
	}

	b.Run("path=grpc-stream", func(b *testing.B) {
		client := startBenchServer(b, redisSrv)
		ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+internalToken)
		run := uniqueRun()
		cpu := startCPU(b, rdb)
		b.ResetTimer()
		parallelBatches(b, func(worker int, batches func() bool) {
			stream, err := client.IngestStream(ctx)
			require.NoError(b, err)
			batch := newBatchTemplate(b, fmt.Sprintf("bench-%s-%d", run, worker), payload)
			for n := 0; batches(); n++ {
				require.NoError(b, stream.SendMsg(batch.request(n)))
			}
			_, err = stream.CloseAndRecv()
			require.NoError(b, err)
		})
		reportItems(b)
		cpu.report(b)
		b.StopTimer()
		require.NoError(b, rdb.FlushAll(context.Background()).Err())
	})

	b.Run("path=raw-xadd", func(b *testing.B) {
		run := uniqueRun()
		cpu := startCPU(b, rdb)
		b.ResetTimer()
		parallelBatches(b, func(worker int, batches func() bool) {
			key := fmt.Sprintf("raw:{bench-%s-%d}:stream", run, worker)
			for batches() {
				_, err := rdb.Pipelined(context.Background(), func(p redis.Pipeliner) error {
					for range benchBatch {
						p.XAdd(context.Background(), &redis.XAddArgs{Stream: key, Values: []any{"b", payload}})
					}
					return nil
				})
				require.NoError(b, err)
			}
		})
		reportItems(b)
		cpu.report(b)
		b.StopTimer()
		require.NoError(b, rdb.FlushAll(context.Background()).Err())
	})
}

var runs atomic.Int64

func uniqueRun() string { return fmt.Sprint(runs.Add(1)) }

// parallelBatches shares b.N batches among benchStreams workers.
func parallelBatches(b *testing.B, worker func(worker int, batches func() bool)) {
	var left atomic.Int64
	left.Store(int64(b.N))
	next := func() bool { return left.Add(-1) >= 0 }
	var wg sync.WaitGroup
	for w := range benchStreams {
		wg.Go(func() { worker(w, next) })
	}
	wg.Wait()
}

func reportItems(b *testing.B) {
	b.ReportMetric(float64(b.N*benchBatch)/b.Elapsed().Seconds(), "items/s")
}

// batchTemplate is one marshalled IngestStreamRequest whose item ids ("i<batch>.<item>",
// the batch number fixed-width) are patched per batch, so the benchmark client spends its
// CPU on copying a batch rather than marshalling it: on a 2-core machine the client's
// marshalling competes with the server it measures. Every batch still has new item ids.
type batchTemplate struct {
	wire    []byte
	numbers []int // offset of each item id's batch number in wire
}

const batchDigits = 9

func newBatchTemplate(b *testing.B, rs string, payload []byte) batchTemplate {
	req := &ingestv1.IngestStreamRequest{RuntimeSessionId: rs}
	for i := range benchBatch {
		req.Items = append(req.Items, &ingestv1.Item{ItemId: fmt.Sprintf("i%0*d.%03d", batchDigits, 0, i), Type: ingestv1.ItemType_ITEM_TYPE_PART, Version: 1, Payload: payload})
	}
	wire, err := proto.Marshal(req)
	require.NoError(b, err)
	t := batchTemplate{wire: wire}
	for _, it := range req.Items {
		at := bytes.Index(wire, []byte(it.ItemId))
		require.Positive(b, at)
		t.numbers = append(t.numbers, at+1)
	}
	return t
}

// request returns batch n, in a buffer of its own (gRPC may send it after SendMsg returns).
func (t batchTemplate) request(n int) *premarshalled {
	wire := slices.Clone(t.wire)
	digits := fmt.Appendf(nil, "%0*d", batchDigits, n)
	for _, at := range t.numbers {
		copy(wire[at:], digits)
	}
	return &premarshalled{wire}
}

// premarshalled is a message already in wire form; clientCodec sends it as is.
type premarshalled struct{ wire []byte }

// clientCodec is the proto codec, except that it passes premarshalled messages through.
// Its name is "proto", so the server decodes with the standard codec.
type clientCodec struct{ encoding.CodecV2 }

func (c clientCodec) Marshal(v any) (mem.BufferSlice, error) {
	if p, ok := v.(*premarshalled); ok {
		return mem.BufferSlice{mem.SliceBuffer(p.wire)}, nil
	}
	return c.CodecV2.Marshal(v)
}

// startBenchServer runs the service on a real TCP listener; the credential service is never
// asked (no scope metadata), so its address needs no server.
func startBenchServer(b *testing.B, redisSrv *redistest.Server) ingestv1.IngestServiceClient {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	serverRedis := redis.NewClient(redisSrv.Options())
	log := slog.New(slog.DiscardHandler)
	srv, err := grpcserver.New(grpcserver.Options{Name: "ingest", Logger: log, Redis: serverRedis, Listener: lis, InternalToken: internalToken,
		ServerOptions: grpcapi.ServerOptions()})
	require.NoError(b, err)
	credConn, err := grpc.NewClient("passthrough:///unused", grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(b, err)
	grpcapi.New(store.New(serverRedis), membership.New(credConn), log).Register(srv)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(clientCodec{encoding.GetCodecV2(grpcproto.Name)})))
	// (The client's windows only govern what it receives; batches flow client → server.)
	require.NoError(b, err)
	b.Cleanup(func() {
		_ = conn.Close()
		cancel()
		require.NoError(b, <-served)
		_ = credConn.Close()
	})
	return ingestv1.NewIngestServiceClient(conn)
}

// cpuMeter reports CPU time per item: of this process (benchmark client and, for the gRPC
// path, the ingest server) and of redis-server (INFO cpu). On a shared 2-core machine these
// say what bounds the throughput better than wall-clock numbers do.
type cpuMeter struct {
	rdb          redis.UniversalClient
	goCPU, rdCPU time.Duration
}

func startCPU(b *testing.B, rdb redis.UniversalClient) *cpuMeter {
	m := &cpuMeter{rdb: rdb}
	m.goCPU, m.rdCPU = processCPU(b), redisCPU(b, rdb)
	return m
}

func (m *cpuMeter) report(b *testing.B) {
	items := float64(b.N * benchBatch)
	b.ReportMetric(float64((processCPU(b)-m.goCPU).Microseconds())/items, "go-cpu-µs/item")
	b.ReportMetric(float64((redisCPU(b, m.rdb)-m.rdCPU).Microseconds())/items, "redis-cpu-µs/item")
}

func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	require.NoError(b, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func redisCPU(b *testing.B, rdb redis.UniversalClient) time.Duration {
	info, err := rdb.Info(context.Background(), "cpu").Result()
	require.NoError(b, err)
	var total float64
	for line := range strings.Lines(info) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
			f, err := strconv.ParseFloat(v, 64)
			require.NoError(b, err)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}
