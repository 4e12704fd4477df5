package store

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/services/ingest/internal/history"
)

// The hand-written encoder must produce exactly what proto.Marshal produces for the same
// ingestv1.Item, field by field, including absent optional fields and extreme values.
func TestEncodeMatchesProto(t *testing.T) {
	items := []history.Item{
		{ID: "a", Type: history.TypePart, Version: 1, Payload: []byte(`{}`)},
		{ID: "b.c:d-e_f", Type: history.TypeNotification, Version: math.MaxUint64, ParentID: "p", Payload: []byte(`"x"`),
			Time: time.Unix(1700000000, 123456789)},
		{ID: "c", Type: history.TypeDiff, Version: 300, Payload: make([]byte, 70000), Time: time.Unix(-5, 0)},
		{ID: "d", Type: history.Type(-1), Version: 2, Payload: []byte(`1`), Time: time.Unix(0, 7)},
		{ID: "e", Version: 1, Payload: []byte(`[]`), Time: time.Unix(0, 0)},
	}
	var want []byte
	for _, it := range items {
		pb := &ingestv1.Item{ItemId: it.ID, Type: ingestv1.ItemType(it.Type), Version: it.Version, ParentId: it.ParentID, Payload: it.Payload}
		if !it.Time.IsZero() {
			pb.Time = timestamppb.New(it.Time)
		}
		one, err := proto.MarshalOptions{Deterministic: true}.Marshal(pb)
		require.NoError(t, err)
		want = protowire.AppendTag(want, entryItemsField, protowire.BytesType)
		want = protowire.AppendBytes(want, one)
	}
	for range 2 { // the second round reuses a pooled buffer
		b := Encode(items)
		require.Equal(t, want, *b.blob)
		require.Len(t, b.args, 3*len(items))
		require.Equal(t, len(want), b.args[len(b.args)-1])
		require.Equal(t, "18446744073709551615", b.args[4])
		require.Equal(t, "00000000000000000001", b.args[1])
		blobPool.Put(b.blob)
	}
}
