// Package store keeps runtime-session history in Redis.
//
// Keys of one runtime session share the hash tag {<runtime-session-id>}, so every script
// touches one slot and the layout works on Redis Cluster:
//
//	ing:{id}:meta    hash: state (live|deleted), session_id, sandbox_id, directory, create_time,
//	                 cursor (of the newest item version written)
//	ing:{id}:stream  stream: one entry per batch, whose field "b" holds the batch's applied
//	                 item versions in order, encoded as the items of an ExportResponse
//	                 (so the script builds it by concatenation); gives order, resume
//	                 cursors and blocking reads for Tail
//	ing:{id}:latest  hash: item id → 20-digit zero-padded version + cursor of that version;
//	                 the newest version of every item, for Export and the version compare
//
// A cursor names one item version: "<entry id>-<index in the entry>", e.g. "1700000000000-0-5".
// One single-field entry per batch rather than an entry (or a field) per item keeps the
// Redis work of a batch at four commands and one linear copy of its bytes, whatever its
// size: a field per item made XADD grow the entry's listpack item by item.
//
// A batch is one Lua script: the tombstone check, every version compare and the XADD run
// in one step, so a batch is all-or-nothing (the service validates it completely before)
// and a replayed batch changes nothing. Versions are compared as fixed-width decimal
// strings because Lua numbers are doubles and would round versions above 2^53.
//
// A tombstone (state=deleted) is kept for TombstoneTTL (default DefaultTombstoneTTL: the
// longest grant lifetime plus the longest retry, decision 12) so that a late retry from a
// runtime cannot recreate a deleted history, and then expires: no runtime holds a handle
// that could still write. The stream and the latest hash are unlinked at deletion.
package store

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

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
	// TombstoneTTL is how long a tombstone outlives its deletion.
	TombstoneTTL time.Duration
}

// DefaultTombstoneTTL is the longest grant lifetime (4 h) plus the longest retry (1 h,
// the exhausted wrapper lease's recheck window): after it no handle of the deleted
// session's runtime can still reach ingest.
const DefaultTombstoneTTL = 5 * time.Hour

// New returns a store on rdb.
func New(rdb redis.UniversalClient) *Store {
	return &Store{rdb: rdb, now: time.Now, TailBlock: time.Second, TombstoneTTL: DefaultTombstoneTTL}
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

// ingestScript reads every stored version with one HMGET, appends the applied versions as
// one stream entry and records them with one HSET. The encoded items arrive as one string
// (ARGV[2]) with each item's end offset, so the usual batch of only new versions is stored
// as is, without creating a Lua string per item.
var ingestScript = redis.NewScript(`
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'deleted' then return {'deleted'} end
if not state then redis.call('HSET', KEYS[1], 'state', 'live', 'create_time', ARGV[1]) end
local n = (#ARGV - 2) / 3
local ids = {}
for k = 1, n do ids[k] = ARGV[3 * k] end
local stored = redis.call('HMGET', KEYS[3], unpack(ids))
local newest = {}
for k = 1, n do
  if stored[k] then newest[ids[k]] = string.sub(stored[k], 1, 20) end
end
local applied = {} -- positions k of the items that go into the entry
for k = 1, n do
  local version = ARGV[3 * k + 1]
  local have = newest[ids[k]]
  if not (have and have >= version) then
    newest[ids[k]] = version
    applied[#applied + 1] = k
  end
end
if #applied == 0 then return {'ok', 0, n, ''} end
local value = ARGV[2]
if #applied < n then
  local parts = {}
  for i, k in ipairs(applied) do
    local first = 1
    if k > 1 then first = tonumber(ARGV[3 * k - 1]) + 1 end
    parts[i] = string.sub(value, first, tonumber(ARGV[3 * k + 2]))
  end
  value = table.concat(parts)
end
local entry = redis.call('XADD', KEYS[2], '*', 'b', value)
local latest = {}
for i, k in ipairs(applied) do
  -- A later duplicate of the same id in this batch overwrites the earlier pair: HSET keeps
  -- the last value given for a field.
  latest[#latest + 1] = ids[k]
  latest[#latest + 1] = ARGV[3 * k + 1] .. entry .. '-' .. (i - 1)
end
redis.call('HSET', KEYS[3], unpack(latest))
local cursor = entry .. '-' .. (#applied - 1)
redis.call('HSET', KEYS[1], 'cursor', cursor)
return {'ok', #applied, n - #applied, cursor}
`)

// Ingest stores one validated batch atomically: each item whose version is newer than the
// stored one is appended to the stream and becomes the item's latest version; the others
// are ignored. A runtime session seen for the first time is created implicitly; a
// tombstoned one is ErrDeleted.
func (s *Store) Ingest(ctx context.Context, id string, items []history.Item) (history.BatchResult, error) {
	return s.IngestEncoded(ctx, id, Encode(items))
}

// EncodedBatch is a batch in its stored form, ready for IngestEncoded.
type EncodedBatch struct {
	blob *[]byte // the encoded items, concatenated; from blobPool, returned by IngestEncoded
	args []any   // item id, padded version, end offset of the encoded item in blob; per item
}

// blobPool recycles the buffers of encoded batches: a batch is up to 4 MiB, and a fresh
// buffer per batch cost more in allocation and zeroing than the encoding itself.
var blobPool sync.Pool

// Encode prepares a validated batch for storing; it does no I/O, so a caller can encode the
// next batch while the previous one is being stored. The batch is stored at most once.
func Encode(items []history.Item) EncodedBatch {
	sizes := make([]int, len(items))
	total := 0
	for i, it := range items {
		sizes[i] = itemSize(it)
		total += protowire.SizeTag(entryItemsField) + protowire.SizeBytes(sizes[i])
	}
	blob, _ := blobPool.Get().(*[]byte)
	if blob == nil || cap(*blob) < total {
		blob = new([]byte)
		*blob = make([]byte, 0, total)
	}
	buf := (*blob)[:0]
	b := EncodedBatch{blob: blob, args: make([]any, 0, 3*len(items))}
	for i, it := range items {
		buf = appendEncoded(buf, it, sizes[i])
		b.args = append(b.args, it.ID, paddedVersion(it.Version), len(buf))
	}
	*blob = buf
	return b
}

// IngestEncoded is Ingest of an encoded batch.
func (s *Store) IngestEncoded(ctx context.Context, id string, b EncodedBatch) (history.BatchResult, error) {
	args := make([]any, 0, 2+len(b.args))
	args = append(append(args, s.now().UnixNano(), *b.blob), b.args...)
	res, err := ingestScript.Run(ctx, s.rdb, keys(id), args...).Slice()
	blobPool.Put(b.blob) // the command is written (and any retry done) once Run returns
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
	var buf [versionWidth]byte
	for i := range buf {
		buf[versionWidth-1-i] = byte('0' + v%10)
		v /= 10
	}
	return string(buf[:])
}

// exportChunk bounds one pipeline of entry reads.
const exportChunk = 64

// Page selects part of an export: items with ids after After (in id order), at most Limit
// of them and, once at least one is taken, no more than MaxBytes of payloads. Zero Limit
// and MaxBytes mean no bound.
type Page struct {
	After    string
	Limit    int
	MaxBytes int
}

// Export returns the newest version of every item the page selects, ordered by item id, the
// cursor of the newest item version at that moment (Tail from it to follow), and whether
// items remain after the page. The index and the cursor are read in one transaction;
// entries are immutable, so reading them afterwards still yields that snapshot unless the
// session is deleted meanwhile (then ErrDeleted).
func (s *Store) Export(ctx context.Context, id string, page Page) (items []history.Item, cursor string, more bool, err error) {
	var meta *redis.SliceCmd
	var latest *redis.MapStringStringCmd
	_, err = s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		meta = p.HMGet(ctx, metaKey(id), "state", "cursor")
		latest = p.HGetAll(ctx, latestKey(id))
		return nil
	})
	if err != nil {
		return nil, "", false, fmt.Errorf("export: %w", err)
	}
	state, _ := meta.Val()[0].(string)
	if err := stateErr(state); err != nil {
		return nil, "", false, err
	}
	cursor, _ = meta.Val()[1].(string)

	ids := make([]string, 0, len(latest.Val()))
	for itemID := range latest.Val() {
		if itemID > page.After {
			ids = append(ids, itemID)
		}
	}
	slices.Sort(ids)
	if page.Limit > 0 && len(ids) > page.Limit {
		ids, more = ids[:page.Limit], true
	}

	// Which item of which entry holds each selected item's newest version.
	wanted := map[string][]int{} // entry id → indexes
	for _, itemID := range ids {
		v := latest.Val()[itemID]
		c, err := parseCursor(v[min(len(v), versionWidth):])
		if err != nil || len(v) <= versionWidth {
			return nil, "", false, fmt.Errorf("export: corrupt latest entry %q", v)
		}
		wanted[c.entry] = append(wanted[c.entry], c.index)
	}
	entries := slices.Sorted(maps.Keys(wanted))
	items = make([]history.Item, 0, len(ids))
	for chunk := range slices.Chunk(entries, exportChunk) {
		cmds, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, e := range chunk {
				p.XRange(ctx, streamKey(id), e, e)
			}
			return nil
		})
		if err != nil {
			return nil, "", false, fmt.Errorf("export: %w", err)
		}
		for i, c := range cmds {
			msgs := c.(*redis.XMessageSliceCmd).Val()
			if len(msgs) != 1 {
				return nil, "", false, history.ErrDeleted // unlinked under us
			}
			inEntry, err := decodeEntry(msgs[0])
			if err != nil {
				return nil, "", false, err
			}
			for _, idx := range wanted[chunk[i]] {
				if idx >= len(inEntry) {
					return nil, "", false, fmt.Errorf("export: entry %s has no item %d", msgs[0].ID, idx)
				}
				items = append(items, inEntry[idx])
			}
		}
	}
	slices.SortFunc(items, func(a, b history.Item) int { return strings.Compare(a.ID, b.ID) })
	if page.MaxBytes > 0 {
		size := 0
		for i, it := range items {
			size += len(it.Payload)
			if size > page.MaxBytes && i > 0 {
				items, more = items[:i], true
				break
			}
		}
	}
	return items, cursor, more, nil
}

// tailCount bounds the entries of one read.
const tailCount = 16

// Tail calls send for every item version after cursor ("" starts at the beginning), in
// order, and keeps following new ones until ctx ends (nil), send fails (its error), or the
// runtime session is deleted (ErrDeleted).
func (s *Store) Tail(ctx context.Context, id, cursor string, send func(history.Entry) error) error {
	after := itemCursor{entry: "0-0", index: -1}
	if cursor != "" {
		var err error
		if after, err = parseCursor(cursor); err != nil {
			return err
		}
	}
	sendEntry := func(m redis.XMessage, from int) error {
		items, err := decodeEntry(m)
		if err != nil {
			return err
		}
		for idx := from; idx < len(items); idx++ {
			if err := send(history.Entry{Item: items[idx], Cursor: itemCursor{m.ID, idx}.String()}); err != nil {
				return err
			}
		}
		return nil
	}
	if after.index >= 0 {
		// The rest of the entry the cursor points into.
		msgs, err := s.rdb.XRange(ctx, streamKey(id), after.entry, after.entry).Result()
		if err != nil {
			return fmt.Errorf("tail: %w", err)
		}
		for _, m := range msgs {
			if err := sendEntry(m, after.index+1); err != nil {
				return err
			}
		}
	}
	last := after.entry
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
			Streams: []string{streamKey(id), last}, Count: tailCount, Block: s.TailBlock,
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
				if err := sendEntry(m, 0); err != nil {
					return err
				}
				last = m.ID
			}
		}
	}
}

// itemCursor names one item version: a stream entry and the item's index in it.
type itemCursor struct {
	entry string
	index int
}

func (c itemCursor) String() string { return c.entry + "-" + strconv.Itoa(c.index) }

// ErrBadCursor: a cursor this service did not hand out.
var ErrBadCursor = errors.New("malformed cursor")

func parseCursor(s string) (itemCursor, error) {
	cut := strings.LastIndexByte(s, '-')
	if cut < 0 {
		return itemCursor{}, ErrBadCursor
	}
	ms, seq, ok := strings.Cut(s[:cut], "-")
	idx, err := strconv.Atoi(s[cut+1:])
	if !ok || err != nil || idx < 0 || !digits(ms) || !digits(seq) {
		return itemCursor{}, ErrBadCursor
	}
	return itemCursor{entry: s[:cut], index: idx}, nil
}

func digits(s string) bool {
	if s == "" || len(s) > 20 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

var deleteScript = redis.NewScript(`
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'state', 'deleted', 'delete_time', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
`)

// Delete tombstones a runtime session and unlinks its history; idempotent, and a runtime
// session never seen is tombstoned too, so a late first ingest cannot create it.
func (s *Store) Delete(ctx context.Context, id string) error {
	ttl := s.TombstoneTTL
	if ttl <= 0 {
		ttl = DefaultTombstoneTTL
	}
	if err := deleteScript.Run(ctx, s.rdb, keys(id), s.now().UnixNano(), ttl.Milliseconds()).Err(); err != nil {
		return fmt.Errorf("delete runtime session: %w", err)
	}
	return nil
}

// appendEncoded appends the stored form of an item version: the protobuf Item as one
// element of the repeated items field of an ExportResponse (tag and length included), so
// concatenated elements decode as one message. Protobuf keeps stored data readable across
// schema changes. It writes the fields directly, in one pass into a buffer sized before,
// rather than building an ingestv1.Item and marshalling it; TestEncodeMatchesProto checks
// the bytes against proto.Marshal. size is itemSize(it).
func appendEncoded(b []byte, it history.Item, size int) []byte {
	b = protowire.AppendTag(b, entryItemsField, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	if it.ID != "" {
		b = protowire.AppendTag(b, itemIDField, protowire.BytesType)
		b = protowire.AppendString(b, it.ID)
	}
	if it.Type != 0 {
		b = protowire.AppendTag(b, itemTypeField, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(int64(it.Type)))
	}
	if it.Version != 0 {
		b = protowire.AppendTag(b, itemVersionField, protowire.VarintType)
		b = protowire.AppendVarint(b, it.Version)
	}
	if it.ParentID != "" {
		b = protowire.AppendTag(b, itemParentIDField, protowire.BytesType)
		b = protowire.AppendString(b, it.ParentID)
	}
	if len(it.Payload) > 0 {
		b = protowire.AppendTag(b, itemPayloadField, protowire.BytesType)
		b = protowire.AppendBytes(b, it.Payload)
	}
	if !it.Time.IsZero() {
		secs, nanos := it.Time.Unix(), int64(it.Time.Nanosecond())
		b = protowire.AppendTag(b, itemTimeField, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(timestampSize(secs, nanos)))
		if secs != 0 {
			b = protowire.AppendTag(b, timestampSecondsField, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(secs))
		}
		if nanos != 0 {
			b = protowire.AppendTag(b, timestampNanosField, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(nanos))
		}
	}
	return b
}

// itemSize is the size of it encoded as an ingestv1.Item.
func itemSize(it history.Item) int {
	n := 0
	if it.ID != "" {
		n += 1 + protowire.SizeBytes(len(it.ID))
	}
	if it.Type != 0 {
		n += 1 + protowire.SizeVarint(uint64(int64(it.Type)))
	}
	if it.Version != 0 {
		n += 1 + protowire.SizeVarint(it.Version)
	}
	if it.ParentID != "" {
		n += 1 + protowire.SizeBytes(len(it.ParentID))
	}
	if len(it.Payload) > 0 {
		n += 1 + protowire.SizeBytes(len(it.Payload))
	}
	if !it.Time.IsZero() {
		n += 1 + protowire.SizeBytes(timestampSize(it.Time.Unix(), int64(it.Time.Nanosecond())))
	}
	return n
}

func timestampSize(secs, nanos int64) int {
	n := 0
	if secs != 0 {
		n += 1 + protowire.SizeVarint(uint64(secs))
	}
	if nanos != 0 {
		n += 1 + protowire.SizeVarint(uint64(nanos))
	}
	return n
}

// Field numbers of ingestv1.Item and google.protobuf.Timestamp (all below 16: one-byte tags).
const (
	itemIDField           = 1
	itemTypeField         = 2
	itemVersionField      = 3
	itemParentIDField     = 4
	itemPayloadField      = 5
	itemTimeField         = 6
	timestampSecondsField = 1
	timestampNanosField   = 2
)

// entryItemsField is ExportResponse.items.
const entryItemsField = 1

// decodeEntry decodes the item versions of one stream entry, in order.
func decodeEntry(m redis.XMessage) ([]history.Item, error) {
	raw, _ := m.Values["b"].(string)
	var pb ingestv1.ExportResponse
	if err := proto.Unmarshal([]byte(raw), &pb); err != nil {
		return nil, fmt.Errorf("decode entry %s: %w", m.ID, err)
	}
	items := make([]history.Item, len(pb.GetItems()))
	for i, p := range pb.GetItems() {
		items[i] = history.Item{
			ID: p.GetItemId(), Type: history.Type(p.GetType()), Version: p.GetVersion(),
			ParentID: p.GetParentId(), Payload: p.GetPayload(),
		}
		if p.Time != nil {
			items[i].Time = p.GetTime().AsTime()
		}
	}
	return items, nil
}
