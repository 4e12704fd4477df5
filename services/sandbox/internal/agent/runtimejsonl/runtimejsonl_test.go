package runtimejsonl

import (
	"bytes"
	"testing"
)

func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"type":"message","session_id":"s1","message_id":"m1","content":"hi"}`))
	f.Add([]byte(`{"type":"event","session_id":"s1","event":{"event_id":"e","kind":"message"}}`))
	f.Add([]byte(`{"type":"outcome","session_id":"s1","outcome":{"result":"succeeded"}}`))
	f.Add([]byte(`{"type":"nope"}`))
	f.Add([]byte(`not json`))
	f.Fuzz(func(t *testing.T, line []byte) {
		fr, err := Parse(line)
		if err != nil {
			return
		}
		var buf bytes.Buffer
		if err := NewWriter(&buf).Write(fr); err != nil {
			t.Fatal(err)
		}
		again, err := Parse(bytes.TrimSpace(buf.Bytes()))
		if err != nil {
			t.Fatalf("re-encoded frame does not parse: %v", err)
		}
		if again.Type != fr.Type || again.SessionID != fr.SessionID {
			t.Fatalf("round trip changed frame: %+v vs %+v", again, fr)
		}
	})
}

func TestParseRejects(t *testing.T) {
	t.Parallel()
	for _, line := range []string{
		`{}`, `{"type":"message"}`, `{"type":"event","session_id":"s"}`,
		`{"type":"outcome","session_id":"s","outcome":{}}`, `[1]`,
	} {
		if _, err := Parse([]byte(line)); err == nil {
			t.Errorf("Parse(%s) accepted", line)
		}
	}
}
