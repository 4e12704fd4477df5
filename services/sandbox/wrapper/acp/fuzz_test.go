package acp

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzParseMessage: any line from an agent is either a JSON-RPC 2.0 call or
// response, or ErrProtocol; never a panic.
func FuzzParseMessage(f *testing.F) {
	for _, s := range []string{
		`{"jsonrpc":"2.0","id":1,"result":{"stopReason":"end_turn"}}`,
		`{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi"}}}}`,
		`{"jsonrpc":"2.0","id":"x","error":{"code":-1,"message":"no"}}`,
		`not json`, `{}`, `{"jsonrpc":"1.0","id":1,"result":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		m, err := parseMessage(line)
		if err != nil {
			require.ErrorIs(t, err, ErrProtocol)
			return
		}
		require.True(t, m.Method != "" || (m.ID != nil && (m.Result != nil || m.Error != nil)))
	})
}

// FuzzMapUpdate: every update maps to at least one event whose data stays
// within the event bound (64 KiB) and is JSON.
func FuzzMapUpdate(f *testing.F) {
	for _, s := range []string{
		`{"sessionUpdate":"tool_call","toolCallId":"t","title":"write","kind":"edit","status":"pending","rawInput":{"a":1}}`,
		`{"sessionUpdate":"tool_call_update","toolCallId":"t","status":"completed","content":[{"type":"content","content":{"type":"text","text":"ok"}}]}`,
		`{"sessionUpdate":"plan","entries":[{"content":"x"}]}`,
		`{"sessionUpdate":"usage_update","used":1}`, `{"sessionUpdate":"whatever"}`, `{}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		var u update
		if json.Unmarshal(raw, &u) != nil {
			return
		}
		evs := mapUpdate(u, raw, toolNames{})
		require.NotEmpty(t, evs, "no update is dropped")
		for _, e := range evs {
			b, err := json.Marshal(e.data)
			require.NoError(t, err)
			require.Less(t, len(b), 64<<10)
			require.NotEmpty(t, e.kind)
		}
	})
}
