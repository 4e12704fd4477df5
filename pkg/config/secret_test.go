package config_test

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/redistest"
)

// secretFile writes content to a fresh file and returns its path.
func secretFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

func loadSecrets(t *testing.T, env map[string]string, args ...string) (config.Common, error) {
	t.Helper()
	env["AGENTPLANE_REDIS_URL"] = "redis://127.0.0.1:1/0"
	return load(t, env, args...)
}

func TestSecretFromFile(t *testing.T) {
	tokenFile := secretFile(t, "tok-from-file\n")

	c, err := loadSecrets(t, map[string]string{"AGENTPLANE_INTERNAL_TOKEN_FILE": tokenFile})
	require.NoError(t, err)
	require.Equal(t, "tok-from-file", c.InternalToken, "read, trailing newline dropped")
	require.Empty(t, c.PlainSecrets())

	c, err = loadSecrets(t, map[string]string{}, "--internal-token-file", secretFile(t, "crlf\r\n\n"))
	require.NoError(t, err)
	require.Equal(t, "crlf", c.InternalToken)

	// The command line wins over the environment, whichever form each uses.
	c, err = loadSecrets(t, map[string]string{"AGENTPLANE_INTERNAL_TOKEN": "env-value"}, "--internal-token-file", tokenFile)
	require.NoError(t, err)
	require.Equal(t, "tok-from-file", c.InternalToken)
	require.Empty(t, c.PlainSecrets())
	c, err = loadSecrets(t, map[string]string{"AGENTPLANE_INTERNAL_TOKEN_FILE": tokenFile}, "--internal-token", "flag-value")
	require.NoError(t, err)
	require.Equal(t, "flag-value", c.InternalToken)
	require.Equal(t, []config.PlainSecret{{Name: "INTERNAL_TOKEN", OnFlag: true}}, c.PlainSecrets())
}

// TestPlainSecretsWarn: the value forms still work (compatibility) and are reported, by
// name only, for the start-up warning.
func TestPlainSecretsWarn(t *testing.T) {
	c, err := load(t, map[string]string{
		"AGENTPLANE_REDIS_URL":      "redis://:hunter2@127.0.0.1:1/0",
		"AGENTPLANE_INTERNAL_TOKEN": "s3cret-token",
	})
	require.NoError(t, err)
	require.Equal(t, "s3cret-token", c.InternalToken)
	plain := c.PlainSecrets()
	require.ElementsMatch(t, []config.PlainSecret{{Name: "REDIS_URL"}, {Name: "INTERNAL_TOKEN"}}, plain)
	for _, p := range plain {
		w := p.Warning()
		require.Contains(t, w, "_FILE")
		require.NotContains(t, w, "hunter2")
		require.NotContains(t, w, "s3cret-token")
	}
	require.Equal(t, "secret AGENTPLANE_INTERNAL_TOKEN is given in the environment: set AGENTPLANE_INTERNAL_TOKEN_FILE to a file holding it instead",
		config.PlainSecret{Name: "INTERNAL_TOKEN"}.Warning())
	require.Contains(t, config.PlainSecret{Name: "INTERNAL_TOKEN", OnFlag: true}.Warning(), "pass --internal-token-file instead")

	// A Redis URL without credentials is no secret: no warning.
	c, err = load(t, map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1/0"})
	require.NoError(t, err)
	require.Empty(t, c.PlainSecrets())
}

func TestSecretFileErrors(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nope")
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want []string
	}{
		{"missing", map[string]string{"AGENTPLANE_INTERNAL_TOKEN_FILE": missing}, nil,
			[]string{"AGENTPLANE_INTERNAL_TOKEN_FILE (--internal-token-file): cannot read the secret file", missing, "no such file"}},
		{"unreadable (a directory)", nil, []string{"--redis-password-file", dir},
			[]string{"AGENTPLANE_REDIS_PASSWORD_FILE (--redis-password-file): cannot read the secret file", "is a directory"}},
		{"empty", map[string]string{"AGENTPLANE_INTERNAL_TOKEN_FILE": secretFile(t, "\n")}, nil,
			[]string{"AGENTPLANE_INTERNAL_TOKEN_FILE (--internal-token-file): secret file", "is empty"}},
		{"too large", map[string]string{"AGENTPLANE_INTERNAL_TOKEN_FILE": secretFile(t, strings.Repeat("x", 65<<10))}, nil,
			[]string{"AGENTPLANE_INTERNAL_TOKEN_FILE (--internal-token-file): secret file", "larger than 64 KiB"}},
		{"both in env", map[string]string{"AGENTPLANE_INTERNAL_TOKEN": "v", "AGENTPLANE_INTERNAL_TOKEN_FILE": missing}, nil,
			[]string{"AGENTPLANE_INTERNAL_TOKEN (--internal-token): give either AGENTPLANE_INTERNAL_TOKEN or AGENTPLANE_INTERNAL_TOKEN_FILE, not both"}},
		{"both on the command line", nil, []string{"--internal-token=v", "--internal-token-file", missing},
			[]string{"give either --internal-token or --internal-token-file, not both"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{}
			for k, v := range tc.env {
				env[k] = v
			}
			_, err := loadSecrets(t, env, tc.args...)
			require.Error(t, err)
			for _, w := range tc.want {
				require.ErrorContains(t, err, w)
			}
			var ce *config.Error
			require.ErrorAs(t, err, &ce)
		})
	}
}

// TestSecretValuesNeverPrinted: neither a bad secret's error nor the -h output carries the
// value, from the environment or a file.
func TestSecretValuesNeverPrinted(t *testing.T) {
	const pw = "hunter2-pw"
	for _, env := range []map[string]string{
		{"AGENTPLANE_REDIS_URL": "redis://:" + pw + "@127.0.0.1:notaport/0"},
		{"AGENTPLANE_REDIS_URL_FILE": secretFile(t, "redis://:"+pw+"@127.0.0.1:notaport/0\n")},
		{"AGENTPLANE_REDIS_URL": "redis+sentinel://:" + pw + "@h%zz:1,h2:2/m"},
		{"AGENTPLANE_REDIS_URL": "redis+cluster://u:" + pw + "@h1:1/%zz"},
	} {
		_, err := load(t, env)
		require.ErrorContains(t, err, "AGENTPLANE_REDIS_URL (--redis-url)")
		require.NotContains(t, err.Error(), pw)
	}

	var usage bytes.Buffer
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(&usage)
	c := config.DefaultCommon("127.0.0.1:7401", "")
	l := config.NewLoader(fs, func(k string) (string, bool) {
		v, ok := map[string]string{"AGENTPLANE_INTERNAL_TOKEN": "tok-" + pw, "AGENTPLANE_REDIS_URL": "redis://:" + pw + "@h:1"}[k]
		return v, ok
	})
	c.Bind(l)
	require.ErrorIs(t, l.Parse([]string{"-h"}), flag.ErrHelp)
	require.Contains(t, usage.String(), "-internal-token-file")
	require.NotContains(t, usage.String(), pw)
}

// TestRedisPasswordFile: the password from REDIS_PASSWORD_FILE authenticates against a real
// redis-server that requires it; the URL alone does not.
func TestRedisPasswordFile(t *testing.T) {
	srv := redistest.Start(t)
	const pw = "r3dis-pass"
	require.NoError(t, srv.Client(t).ConfigSet(t.Context(), "requirepass", pw).Err())

	c, err := load(t, map[string]string{"AGENTPLANE_REDIS_URL": srv.URL(), "AGENTPLANE_REDIS_PASSWORD_FILE": secretFile(t, pw+"\n")})
	require.NoError(t, err)
	rdb, err := c.Redis()
	require.NoError(t, err)
	require.NoError(t, rdb.Ping(t.Context()).Err())
	require.NoError(t, rdb.Close())

	c.RedisPassword = ""
	rdb, err = c.Redis()
	require.NoError(t, err)
	require.ErrorContains(t, rdb.Ping(t.Context()).Err(), "NOAUTH")
	require.NoError(t, rdb.Close())
}

func TestReadSecretFile(t *testing.T) {
	v, err := config.ReadSecretFile(secretFile(t, "  spaced value \n"))
	require.NoError(t, err)
	require.Equal(t, "  spaced value ", v, "only newlines are trimmed")
	_, err = config.ReadSecretFile("")
	require.ErrorContains(t, err, "empty path")
}
