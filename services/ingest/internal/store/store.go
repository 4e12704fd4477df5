// Package store keeps runtime-session history in Redis.
//
// Keys of one runtime session share the hash tag {<runtime-session-id>}, so every script
// touches one slot and the layout works on Redis Cluster:
//
//	ing:{id}:meta    hash: state (live|deleted), session_id, sandbox_id, directory, create_time
//	ing:{id}:stream  stream: one entry per applied item version, field "b" = the encoded item;
//	                 gives order, resume cursors (entry ids) and blocking reads for Tail
//	ing:{id}:latest  hash: item id → 20-digit zero-padded version + entry id of that version;
//	                 the newest version of every item, for Export and the version compare
//
// A batch is one Lua script: the tombstone check, every version compare and every XADD run
// in one step, so a batch is all-or-nothing (the service validates it completely before)
// and a replayed batch changes nothing. Versions are compared as fixed-width decimal
// strings because Lua numbers are doubles and would round versions above 2^53.
//
// A tombstone (state=deleted) is kept forever so that a late retry from a runtime cannot
// recreate a deleted history; the stream and the latest hash are unlinked at deletion.
package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/services/ingest/internal/history"
)

// Keys of one runtime session.
func metaKey(id string) string   { return "ing:{" + id + "}:meta" }
func streamKey(id string) string { return "ing:{" + id + "}:stream" }
func latestKey(id string) string { return "ing:{" + id + "}:latest" }

func keys(id string) []string { return []string{metaKey(id), streamKey(id), latestKey(id)} }

const (
	stateLive    = "live"
	stateDeleted = "deleted"
	versionWidth = 20 // digits of math.MaxUint64
)

// Store is the Redis side of the ingest service.
type Store struct {
	rdb redis.UniversalClient
	now func() time.Time
	// TailBlock bounds one blocking read of Tail; between reads Tail notices a tombstone
	// and a cancelled caller.
	TailBlock time.Duration
}

// New returns a store on rdb.
func New(rdb redis.UniversalClient) *Store {
	return &Store{rdb: rdb, now: time.Now, TailBlock: time.Second}
}

// The tombstone answer of every script.
const deletedReply = "deleted"

var createScript = redis.NewScript(`
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'deleted' then return 'deleted' end
local names = {'session_id', 'sandbox_id', 'directory'}
if state then
  for i, name in ipairs(names) do
    local cur = redis.call('HGET', KEYS[1], name)
    if cur and cur ~= '' and ARGV[i] ~= '' and cur ~= ARGV[i] then return 'conflict' end
  end
else
  redis.call('HSET', KEYS[1], 'state', 'live', 'create_time', ARGV[4])
end
for i, name in ipairs(names) do
  if ARGV[i] ~= '' then redis.call('HSET', KEYS[1], name, ARGV[i]) end
end
return 'ok'
`)

// CreateRuntimeSession registers rs, or fills in metadata an implicit creation (first
// ingest) left empty. It is idempotent; other non-empty metadata is ErrConflict.
func (s *Store) CreateRuntimeSession(ctx context.Context, rs history.RuntimeSession) (history.RuntimeSession, error) {
	res, err := createScript.Run(ctx, s.rdb, keys(rs.ID), rs.SessionID, rs.SandboxID, rs.Directory, s.now().UnixNano()).Text()
	if err != nil {
		return history.RuntimeSession{}, fmt.Errorf("create runtime session: %w", err)
	}
	switch res {
	case deletedReply:
		return history.RuntimeSession{}, history.ErrDeleted
	case "conflict":
		return history.RuntimeSession{}, history.ErrConflict
	}
	return s.RuntimeSession(ctx, rs.ID)
}

// RuntimeSession reads a runtime session's metadata.
func (s *Store) RuntimeSession(ctx context.Context, id string) (history.RuntimeSession, error) {
	m, err := s.rdb.HGetAll(ctx, metaKey(id)).Result()
	if err != nil {
		return history.RuntimeSession{}, fmt.Errorf("read runtime session: %w", err)
	}
	if err := stateErr(m["state"]); err != nil {
		return history.RuntimeSession{}, err
	}
	nanos, _ := strconv.ParseInt(m["create_time"], 10, 64)
	return history.RuntimeSession{
		ID: id, SessionID: m["session_id"], SandboxID: m["sandbox_id"], Directory: m["directory"],
		CreateTime: time.Unix(0, nanos).UTC(),
	}, nil
}

func stateErr(state string) error {
	switch state {
	case stateLive:
		return nil
	case stateDeleted:
		return history.ErrDeleted
	default:
		return history.ErrNotFound
	}
}

var ingestScript = redis.NewScript(`
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'deleted' then return {'deleted'} end
if not state then redis.call('HSET', KEYS[1], 'state', 'live', 'create_time', ARGV[1]) end
local applied, ignored, cursor = 0, 0, ''
for i = 2, #ARGV, 3 do
  local id, version = ARGV[i], ARGV[i + 1]
  local cur = redis.call('HGET', KEYS[3], id)
  if cur and string.sub(cur, 1, 20) >= version then
    ignored = ignored + 1
  else
    cursor = redis.call('XADD', KEYS[2], '*', 'b', ARGV[i + 2])
    redis.call('HSET', KEYS[3], id, version .. cursor)
    applied = applied + 1
  end
end
return {'ok', applied, ignored, cursor}
`)

// Ingest stores one validated batch atomically: each item whose version is newer than the
// stored one is appended to the stream and becomes the item's latest version; the others
// are ignored. A runtime session seen for the first time is created implicitly; a
// tombstoned one is ErrDeleted.
func (s *Store) Ingest(ctx context.Context, id string, items []history.Item) (history.BatchResult, error) {
	args := make([]any, 0, 1+3*len(items))
	args = append(args, s.now().UnixNano())
	for _, it := range items {
		blob, err := encode(it)
		if err != nil {
			return history.BatchResult{}, err
		}
		args = append(args, it.ID, paddedVersion(it.Version), blob)
	}
	res, err := ingestScript.Run(ctx, s.rdb, keys(id), args...).Slice()
	if err != nil {
		return history.BatchResult{}, fmt.Errorf("ingest batch: %w", err)
	}
	if len(res) == 1 && res[0] == deletedReply {
		return history.BatchResult{}, history.ErrDeleted
	}
	if len(res) != 4 {
		return history.BatchResult{}, fmt.Errorf("ingest batch: unexpected reply %v", res)
	}
	applied, _ := res[1].(int64)
	ignored, _ := res[2].(int64)
	cursor, _ := res[3].(string)
	return history.BatchResult{Applied: int(applied), Ignored: int(ignored), Cursor: cursor}, nil
}

func paddedVersion(v uint64) string {
	s := strconv.FormatUint(v, 10)
	return strings.Repeat("0", versionWidth-len(s)) + s
}

// exportChunk bounds one pipeline of entry reads.
const exportChunk = 512

// Export returns the newest version of every item, ordered by item id, and the cursor of
// the newest stream entry at that moment (Tail from it to follow). The index and the
// cursor are read in one transaction; entries are immutable, so reading them afterwards
// still yields that snapshot unless the session is deleted meanwhile (then ErrDeleted).
func (s *Store) Export(ctx context.Context, id string) ([]history.Item, string, error) {
	var state *redis.StringCmd
	var last *redis.XMessageSliceCmd
	var latest *redis.MapStringStringCmd
	_, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		state = p.HGet(ctx, metaKey(id), "state")
		last = p.XRevRangeN(ctx, streamKey(id), "+", "-", 1)
		latest = p.HGetAll(ctx, latestKey(id))
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, "", fmt.Errorf("export: %w", err)
	}
	if err := stateErr(state.Val()); err != nil {
		return nil, "", err
	}
	cursor := ""
	if msgs := last.Val(); len(msgs) > 0 {
		cursor = msgs[0].ID
	}
	entryIDs := make([]string, 0, len(latest.Val()))
	for _, v := range latest.Val() {
		if len(v) <= versionWidth {
			return nil, "", fmt.Errorf("export: corrupt latest entry %q", v)
		}
		entryIDs = append(entryIDs, v[versionWidth:])
	}
	items := make([]history.Item, 0, len(entryIDs))
	for chunk := range slices.Chunk(entryIDs, exportChunk) {
		cmds, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, e := range chunk {
				p.XRange(ctx, streamKey(id), e, e)
			}
			return nil
		})
		if err != nil {
			return nil, "", fmt.Errorf("export: %w", err)
		}
		for _, c := range cmds {
			msgs := c.(*redis.XMessageSliceCmd).Val()
			if len(msgs) != 1 {
				return nil, "", history.ErrDeleted // unlinked under us
			}
			it, err := decode(msgs[0])
			if err != nil {
				return nil, "", err
			}
			items = append(items, it)
		}
	}
	slices.SortFunc(items, func(a, b history.Item) int { return strings.Compare(a.ID, b.ID) })
	return items, cursor, nil
}

// tailCount bounds the entries of one read.
const tailCount = 256

// Tail calls send for every entry after cursor ("" starts at the beginning), in order, and
// keeps following new entries until ctx ends (nil), send fails (its error), or the runtime
// session is deleted (ErrDeleted).
func (s *Store) Tail(ctx context.Context, id, cursor string, send func(history.Entry) error) error {
	if cursor == "" {
		cursor = "0-0"
	}
	for {
		state, err := s.rdb.HGet(ctx, metaKey(id), "state").Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("tail: %w", err)
		}
		if err := stateErr(state); err != nil {
			return err
		}
		streams, err := s.rdb.XRead(ctx, &redis.XReadArgs{
			Streams: []string{streamKey(id), cursor}, Count: tailCount, Block: s.TailBlock,
		}).Result()
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, redis.Nil) {
			continue // nothing new within TailBlock: check the tombstone again
		}
		if err != nil {
			return fmt.Errorf("tail: %w", err)
		}
		for _, st := range streams {
			for _, m := range st.Messages {
				it, err := decode(m)
				if err != nil {
					return err
				}
				if err := send(history.Entry{Item: it, Cursor: m.ID}); err != nil {
					return err
				}
				cursor = m.ID
			}
		}
	}
}

var deleteScript = redis.NewScript(`
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'state', 'deleted', 'delete_time', ARGV[1])
return 1
`)

// Delete tombstones a runtime session and unlinks its history; idempotent, and a runtime
// session never seen is tombstoned too, so a late first ingest cannot create it.
func (s *Store) Delete(ctx context.Context, id string) error {
	if err := deleteScript.Run(ctx, s.rdb, keys(id), s.now().UnixNano()).Err(); err != nil {
		return fmt.Errorf("delete runtime session: %w", err)
	}
	return nil
}

// encode is the stored form of an item version: the protobuf Item, which keeps the stored
// data readable across schema changes the protobuf way.
func encode(it history.Item) ([]byte, error) {
	pb := &ingestv1.Item{
		ItemId: it.ID, Type: ingestv1.ItemType(it.Type), Version: it.Version,
		ParentId: it.ParentID, Payload: it.Payload,
	}
	if !it.Time.IsZero() {
		pb.Time = timestamppb.New(it.Time)
	}
	b, err := proto.Marshal(pb)
	if err != nil {
		return nil, fmt.Errorf("encode item: %w", err)
	}
	return b, nil
}

func decode(m redis.XMessage) (history.Item, error) {
	raw, _ := m.Values["b"].(string)
	var pb ingestv1.Item
	if err := proto.Unmarshal([]byte(raw), &pb); err != nil {
		return history.Item{}, fmt.Errorf("decode entry %s: %w", m.ID, err)
	}
	it := history.Item{
		ID: pb.GetItemId(), Type: history.Type(pb.GetType()), Version: pb.GetVersion(),
		ParentID: pb.GetParentId(), Payload: pb.GetPayload(),
	}
	if pb.Time != nil {
		it.Time = pb.GetTime().AsTime()
	}
	return it, nil
}
