package history

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func validItem() Item {
	return Item{ID: "msg-1", Type: TypeMessage, Version: 1, Payload: []byte(`{"text":"hi"}`)}
}

func TestValidateItem(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Item)
		fields []string
	}{
		{"valid", func(*Item) {}, nil},
		{"valid with parent", func(it *Item) { it.ParentID = "msg-0:part.1_x" }, nil},
		{"empty id", func(it *Item) { it.ID = "" }, []string{"items[0].item_id"}},
		{"long id", func(it *Item) { it.ID = strings.Repeat("a", 129) }, []string{"items[0].item_id"}},
		{"id with brace", func(it *Item) { it.ID = "a{b}" }, []string{"items[0].item_id"}},
		{"bad parent", func(it *Item) { it.ParentID = "a/b" }, []string{"items[0].parent_id"}},
		{"unspecified type", func(it *Item) { it.Type = TypeUnspecified }, []string{"items[0].type"}},
		{"unknown type", func(it *Item) { it.Type = typeEnd }, []string{"items[0].type"}},
		{"version zero", func(it *Item) { it.Version = 0 }, []string{"items[0].version"}},
		{"payload not json", func(it *Item) { it.Payload = []byte(`{"a":`) }, []string{"items[0].payload"}},
		{"payload empty", func(it *Item) { it.Payload = nil }, []string{"items[0].payload"}},
		{"payload too large", func(it *Item) { it.Payload = bigJSON(MaxItemPayloadBytes + 1) }, []string{"items[0].payload"}},
		{"everything wrong", func(it *Item) { *it = Item{ParentID: "?"} }, []string{"items[0].item_id", "items[0].type", "items[0].version", "items[0].parent_id", "items[0].payload"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			it := validItem()
			tt.mutate(&it)
			var fields []string
			for _, v := range ValidateItem("items[0]", it) {
				fields = append(fields, v.Field)
			}
			require.Equal(t, tt.fields, fields)
		})
	}
}

func TestPayloadAtLimitIsValid(t *testing.T) {
	it := validItem()
	it.Payload = bigJSON(MaxItemPayloadBytes)
	require.Empty(t, ValidateItem("items[0]", it))
}

func TestValidateBatchLimits(t *testing.T) {
	many := make([]Item, MaxBatchItems+1)
	for i := range many {
		many[i] = validItem()
	}
	vs := ValidateBatch(many)
	require.Len(t, vs, 1)
	require.Equal(t, "items", vs[0].Field)
	require.True(t, vs[0].Limit)

	require.Empty(t, ValidateBatch(many[:MaxBatchItems]))

	heavy := []Item{validItem(), validItem(), validItem()}
	for i := range heavy {
		heavy[i].Payload = bigJSON(1<<20 + 512<<10) // 1.5 MiB each, 4.5 MiB together
	}
	vs = ValidateBatch(heavy)
	require.Len(t, vs, 1)
	require.Equal(t, "items", vs[0].Field)
	require.Contains(t, vs[0].Description, "bytes")

	vs = ValidateBatch(nil)
	require.Equal(t, []Violation{{Field: "items", Description: "must hold at least one item"}}, vs)

	mixed := []Item{validItem(), validItem(), validItem(), validItem()}
	mixed[3].Payload = bigJSON(MaxItemPayloadBytes + 1)
	err := Invalid(ValidateBatch(mixed))
	var inv *InvalidError
	require.ErrorAs(t, err, &inv)
	require.True(t, inv.HasLimit())
	require.Equal(t, "items[3].payload", inv.Violations[0].Field)
}

// bigJSON is a JSON string of exactly n bytes.
func bigJSON(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'x'
	}
	b[0], b[n-1] = '"', '"'
	return b
}

// FuzzValidateItem checks the validator on arbitrary outside input: it never panics, and
// what it accepts really satisfies every rule the store relies on.
func FuzzValidateItem(f *testing.F) {
	f.Add("msg-1", int32(2), uint64(1), "", []byte(`{"text":"hi"}`))
	f.Add("", int32(0), uint64(0), "p", []byte(`{`))
	f.Add("a{b}", int32(9), uint64(1<<63), "x:y", []byte(`null`))
	f.Add("ok", int32(-1), uint64(7), "bad parent", []byte("\xff"))
	f.Fuzz(func(t *testing.T, id string, typ int32, version uint64, parent string, payload []byte) {
		it := Item{ID: id, Type: Type(typ), Version: version, ParentID: parent, Payload: payload}
		vs := ValidateItem("items[0]", it)
		for _, v := range vs {
			require.True(t, strings.HasPrefix(v.Field, "items[0]."), v.Field)
			require.NotEmpty(t, v.Description)
		}
		if len(vs) > 0 {
			return
		}
		require.True(t, ValidID(id))
		require.NotContains(t, id, "{")
		require.NotContains(t, id, "}")
		require.LessOrEqual(t, len(id), MaxIDLength)
		require.True(t, Type(typ).Known())
		require.GreaterOrEqual(t, version, uint64(1))
		require.True(t, parent == "" || ValidID(parent))
		require.LessOrEqual(t, len(payload), MaxItemPayloadBytes)
		require.True(t, json.Valid(payload))
	})
}
