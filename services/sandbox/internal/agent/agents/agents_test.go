package agents

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestResolve(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	oc := OpenCodeBinary(dir)
	require.NoError(t, os.MkdirAll(filepath.Dir(oc), 0o755))
	require.NoError(t, os.WriteFile(oc, []byte("#!/bin/sh\n"), 0o755))
	notExec := filepath.Join(dir, "plain")
	require.NoError(t, os.WriteFile(notExec, nil, 0o644))
	r := New(Config{Dir: dir, ACPCommand: []string{notExec, "--acp"}, Model: "m-1"})

	s, err := r.Resolve("", "")
	require.NoError(t, err)
	require.Equal(t, Spec{Profile: Scripted, Protocol: ProtocolJSONL}, s, "the default profile")

	s, err = r.Resolve(OpenCode, "")
	require.NoError(t, err)
	require.Equal(t, []string{oc, "acp"}, s.Command)
	require.Equal(t, "m-1", s.Model, "the profile's default model")
	require.Equal(t, "OPENCODE_CONFIG", s.ConfigEnv)

	s, err = r.Resolve(OpenCode, "gpt-4o/mini:1")
	require.NoError(t, err)
	require.Equal(t, "gpt-4o/mini:1", s.Model)

	for name, c := range map[string]struct{ profile, model string }{
		"unknown":        {"nope", ""},
		"not installed":  {Kilo, ""},
		"not executable": {ACP, ""},
	} {
		_, err := r.Resolve(c.profile, c.model)
		require.ErrorIs(t, err, ErrUnavailable, name)
	}
	_, err = r.Resolve(OpenCode, `x","evil":"`)
	require.ErrorIs(t, err, ErrBadModel, "a model name cannot break out of the JSON config")
	_, err = New(Config{}).Resolve(OpenCode, "")
	require.ErrorIs(t, err, ErrUnavailable, "no agents directory: no opencode")
}

func TestSpecRoundTripAndRender(t *testing.T) {
	t.Parallel()
	s := Spec{Profile: OpenCode, Protocol: ProtocolACP, Command: []string{"/a/opencode", "acp"}, ConfigEnv: "OPENCODE_CONFIG",
		ConfigTemplate: opencodeConfig, Model: "m"}
	got, err := ParseSpec(s.Encode())
	require.NoError(t, err)
	require.Equal(t, s, got)
	_, err = ParseSpec(`{"protocol":"acp"}`)
	require.Error(t, err, "an acp spec needs a command")
	_, err = ParseSpec(`{"protocol":"telepathy"}`)
	require.Error(t, err)

	out := Render(opencodeConfig, "http://127.0.0.1:9/v1", "m", "dummy")
	require.JSONEq(t, `{"provider":{"agentplane":{"npm":"@ai-sdk/openai-compatible","name":"agentplane",
		"options":{"baseURL":"http://127.0.0.1:9/v1","apiKey":"dummy"},"models":{"m":{"name":"m"}}}},
		"enabled_providers":["agentplane"],"autoupdate":false,"share":"disabled","model":"agentplane/m"}`, out)
}

func FuzzParseSpec(f *testing.F) {
	f.Add(Spec{Profile: "acp", Protocol: ProtocolACP, Command: []string{"x"}}.Encode())
	f.Add(`{"protocol":"jsonl"}`)
	f.Add(`{`)
	f.Fuzz(func(t *testing.T, v string) {
		s, err := ParseSpec(v)
		if err == nil && s.Protocol == ProtocolACP {
			require.NotEmpty(t, s.Command)
		}
	})
}

// A profile's expected denials: the built-in ones, those the
// configuration adds, exact hosts and "*." suffixes; the default profile
// answers for "".
func TestExpectsDenial(t *testing.T) {
	t.Parallel()
	extra, err := ParseExpectedDenials("scripted=telemetry.example|*.sentry.io, kilo=events.example")
	require.NoError(t, err)
	r := New(Config{Dir: t.TempDir(), ExpectedDenials: extra})
	for _, c := range []struct {
		profile, host string
		want          bool
	}{
		{"kilo", "us.i.posthog.com", true},
		{"kilo", "US.I.POSTHOG.COM.", true},
		{"kilo", "events.example", true},
		{"kilo", "example.com", false},
		{"opencode", "registry.npmjs.org", true},
		{"opencode", "us.i.posthog.com", false},
		{"scripted", "telemetry.example", true},
		{"", "telemetry.example", true},
		{"scripted", "o1.ingest.sentry.io", true},
		{"scripted", "sentry.io", false},
		{"scripted", "eviltelemetry.example", false},
		{"nope", "telemetry.example", false},
	} {
		require.Equal(t, c.want, r.ExpectsDenial(c.profile, c.host), "%s %s", c.profile, c.host)
	}
	for _, bad := range []string{"kilo", "kilo=", "=h.example", "kilo=Upper.example", "kilo=a..b", "kilo=*.", "kilo=h.example:443"} {
		_, err := ParseExpectedDenials(bad)
		require.Error(t, err, bad)
	}
	none, err := ParseExpectedDenials("")
	require.NoError(t, err)
	require.Empty(t, none)
}
