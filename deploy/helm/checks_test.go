package helm

import (
	"os"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
)

// TestStrictLint runs the Helm SDK's lint in strict mode (warnings fail, as `helm lint
// --strict`) once per ci/ values file, the way chart-testing lints a chart.
func TestStrictLint(t *testing.T) {
	kv, err := chartutil.ParseKubeVersion(kubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range ciFiles(t) {
		lint := action.NewLint()
		lint.Strict = true
		lint.Namespace = namespace
		lint.KubeVersion = kv
		res := lint.Run([]string{chartDir}, readValues(t, f))
		if res.TotalChartsLinted != 1 {
			t.Errorf("%s: linted %d charts", f, res.TotalChartsLinted)
		}
		for _, e := range res.Errors {
			t.Errorf("%s: lint error: %v", f, e)
		}
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: strict lint: %s", f, m)
			}
		}
	}
}

// TestStrictLintCatchesProblems proves the lint above can fail: a values file that breaks the
// schema is an error.
func TestStrictLintCatchesProblems(t *testing.T) {
	lint := action.NewLint()
	lint.Strict = true
	res := lint.Run([]string{chartDir}, map[string]any{"redis": map[string]any{"url": "redis://r:6379"}, "sesion": map[string]any{}})
	if len(res.Errors) == 0 {
		t.Fatal("lint accepted an unknown top-level key")
	}
}

// TestSchemaRejects: values that break values.schema.json fail to render, with the schema's
// own message naming the offending value.
func TestSchemaRejects(t *testing.T) {
	base := func() map[string]any { return map[string]any{"redis": map[string]any{"url": "redis://redis:6379/0"}} }
	cases := []struct {
		name string
		edit func(v map[string]any)
		want []string
	}{
		{"unknown top-level key", func(v map[string]any) { v["sesion"] = map[string]any{"replicas": 2} },
			[]string{"additional properties 'sesion' not allowed"}},
		{"unknown component key", func(v map[string]any) { v["session"] = map[string]any{"replica": 2} },
			[]string{"/session", "additional properties 'replica' not allowed"}},
		{"port is a string", func(v map[string]any) { v["session"] = map[string]any{"ports": map[string]any{"grpc": "7401"}} },
			[]string{"/session/ports/grpc", "got string, want integer"}},
		{"port out of range", func(v map[string]any) { v["ingest"] = map[string]any{"ports": map[string]any{"metrics": 70000}} },
			[]string{"/ingest/ports/metrics", "maximum"}},
		{"redis url scheme", func(v map[string]any) { v["redis"] = map[string]any{"url": "http://redis:6379"} },
			[]string{"/redis/url", "does not match pattern"}},
		{"log level", func(v map[string]any) { v["log"] = map[string]any{"level": "verbose"} },
			[]string{"/log/level", "value must be one of"}},
		{"negative replicas", func(v map[string]any) { v["sandbox"] = map[string]any{"replicas": -1} },
			[]string{"/sandbox/replicas", "minimum"}},
		{"credential key not 32 bytes", func(v map[string]any) { v["secrets"] = map[string]any{"credentialKey": "c2hvcnQ="} },
			[]string{"/secrets/credentialKey", "does not match pattern"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v := base()
			tc.edit(v)
			_, err := render(t, v)
			if err == nil {
				t.Fatal("rendered values that break the schema")
			}
			msg := err.Error()
			for _, w := range append([]string{"values don't meet the specifications of the schema"}, tc.want...) {
				if !strings.Contains(msg, w) {
					t.Errorf("error lacks %q:\n%s", w, msg)
				}
			}
		})
	}
}

// TestSchemaRejectsFile: the same through a values file on disk, as `helm install -f` does.
func TestSchemaRejectsFile(t *testing.T) {
	path := t.TempDir() + "/bad-values.yaml"
	writeFile(t, path, "redis:\n  url: redis://r:6379\nsession:\n  replicas: two\n")
	_, err := render(t, readValues(t, path))
	if err == nil || !strings.Contains(err.Error(), "/session/replicas") || !strings.Contains(err.Error(), "got string, want integer") {
		t.Fatalf("want a schema error on /session/replicas, got %v", err)
	}
}

func TestNoRedisFailsWithGuidance(t *testing.T) {
	_, err := render(t, map[string]any{})
	if err == nil || !strings.Contains(err.Error(), "no Redis configured") {
		t.Fatalf("want the no-Redis message, got %v", err)
	}
}

// TestPrivilegedOnlyWhereAsked: a component's values may ask for privileged; only that
// container becomes privileged, and the per-component overlay can switch a default off.
func TestPrivilegedOnlyWhereAsked(t *testing.T) {
	vals := map[string]any{
		"redis": map[string]any{"url": "redis://r:6379"},
		"sandbox": map[string]any{"containerSecurityContext": map[string]any{
			"privileged": true, "allowPrivilegeEscalation": true, "readOnlyRootFilesystem": false}},
	}
	r, err := render(t, vals)
	if err != nil {
		t.Fatal(err)
	}
	checkPrivileged(t, r, map[string]bool{"sandbox": true})
	for _, w := range r.workloads() {
		sc := w.pod.Spec.Containers[0].SecurityContext
		ro := sc != nil && sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem
		if ro != (w.component != "sandbox") {
			t.Errorf("%s: readOnlyRootFilesystem = %v", w.component, ro)
		}
	}
}

// TestPDBOnlyWhenReplicated: two replicas of one service give that service, and only it, a PDB.
func TestPDBOnlyWhenReplicated(t *testing.T) {
	vals := map[string]any{"redis": map[string]any{"url": "redis://r:6379"}, "ingest": map[string]any{"replicas": 2}}
	r, err := render(t, vals)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.pdbs) != 1 || r.pdbs[0].Name != releaseName+"-agentplane-ingest" {
		t.Fatalf("want one PDB for ingest, got %d", len(r.pdbs))
	}
	checkAll(t, r, valuesOf(t, vals))
}

// TestGracePeriodFollowsShutdown: terminationGracePeriodSeconds tracks the drain and stop bounds.
func TestGracePeriodFollowsShutdown(t *testing.T) {
	vals := map[string]any{"redis": map[string]any{"url": "redis://r:6379"},
		"shutdown": map[string]any{"drainDelaySeconds": 30, "timeoutSeconds": 90, "extraGraceSeconds": 1}}
	r, err := render(t, vals)
	if err != nil {
		t.Fatal(err)
	}
	checkGracePeriod(t, r)
	if cfg := configData(t, r); cfg["AGENTPLANE_DRAIN_DELAY"] != "30s" || cfg["AGENTPLANE_SHUTDOWN_TIMEOUT"] != "90s" {
		t.Errorf("config: %v", cfg)
	}
	for _, w := range r.workloads() {
		if g := w.pod.Spec.TerminationGracePeriodSeconds; g == nil || *g != 121 {
			t.Errorf("%s: terminationGracePeriodSeconds = %v, want 121", w.component, g)
		}
	}
}

// TestRedisPasswordFromFile: a password from the Secret reaches the services as a file
// (AGENTPLANE_REDIS_PASSWORD_FILE), the URL stays as given, and a URL carrying a password
// fails to render with guidance; a user name alone may stay in the URL.
func TestRedisPasswordFromFile(t *testing.T) {
	for _, url := range []string{"redis://r:6379/0", "redis+sentinel://s1:26379,s2:26379/mymaster/0", "rediss://acl-user@r:6380"} {
		vals := map[string]any{"redis": map[string]any{"url": url, "password": "s3cret"}}
		r, err := render(t, vals)
		if err != nil {
			t.Fatal(err)
		}
		checkAll(t, r, valuesOf(t, vals))
		for _, w := range r.workloads() {
			c := w.pod.Spec.Containers[0]
			if w.component == "redis" {
				continue
			}
			if got := envValue(c, "AGENTPLANE_REDIS_URL"); got != url {
				t.Errorf("%s: AGENTPLANE_REDIS_URL = %q, want %q", w.component, got, url)
			}
			if envValue(c, "AGENTPLANE_REDIS_PASSWORD_FILE") == "" {
				t.Errorf("%s: no AGENTPLANE_REDIS_PASSWORD_FILE", w.component)
			}
		}
	}
	for _, url := range []string{"rediss://user:pw@r:6380", "redis+sentinel://:pw@s1:26379,s2:26379/m", "unix://:pw@/run/redis.sock"} {
		_, err := render(t, map[string]any{"redis": map[string]any{"url": url}})
		if err == nil || !strings.Contains(err.Error(), "redis.url carries a password: put it in redis.password") {
			t.Errorf("%s: want the password-in-URL message, got %v", url, err)
		}
	}
}

// TestSandboxIsolation: sandbox.isolation renders AGENTPLANE_SANDBOX_ISOLATION and, for
// namespaces (the default), the pod settings bubblewrap needs; none renders none of them
// and warns in NOTES.txt; anything else is refused by the schema.
func TestSandboxIsolation(t *testing.T) {
	for _, tc := range []struct {
		name string
		vals map[string]any
	}{
		{"default", map[string]any{}},
		{"namespaces", map[string]any{"sandbox": map[string]any{"isolation": "namespaces"}}},
		{"none", map[string]any{"sandbox": map[string]any{"isolation": "none"}}},
		{"localhost seccomp profile", map[string]any{"sandbox": map[string]any{"namespaces": map[string]any{
			"seccompProfile": map[string]any{"type": "Localhost", "localhostProfile": "profiles/agentplane-sandbox.json"}}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.vals["redis"] = map[string]any{"url": "redis://r:6379/0"}
			r, err := render(t, tc.vals)
			if err != nil {
				t.Fatal(err)
			}
			checkAll(t, r, valuesOf(t, tc.vals)) // checkIsolation asserts what each value renders
		})
	}
	_, err := render(t, map[string]any{"redis": map[string]any{"url": "redis://r:6379/0"}, "sandbox": map[string]any{"isolation": "off"}})
	if err == nil || !strings.Contains(err.Error(), "/sandbox/isolation") {
		t.Fatalf("want a schema error on /sandbox/isolation, got %v", err)
	}
}

// TestNoSecretValueInEnv: with every secret given in values, no value reaches any
// container's environment, arguments or the ConfigMap; each service gets only its own keys.
func TestNoSecretValueInEnv(t *testing.T) {
	vals := map[string]any{
		"redis": map[string]any{"password": "redis-pw-value", "bundled": map[string]any{"enabled": true}},
		"secrets": map[string]any{
			"internalToken":  "internal-token-value",
			"credentialKey":  "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
			"attestationKey": "attestation-key-value-attestation-key-value",
		},
	}
	r, err := render(t, vals)
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, r, valuesOf(t, vals))
	if len(r.secrets) != 1 || len(r.secrets[0].Data) != 4 {
		t.Fatalf("want the managed Secret with 4 keys, got %d Secrets", len(r.secrets))
	}
	if got := string(r.secrets[0].Data["internal-token"]); got != "internal-token-value" {
		t.Fatalf("the Secret holds %q, not the value given", got)
	}
}

// TestStrictDecoding proves the decoder used on every manifest rejects unknown fields,
// duplicate fields and kinds the test does not know.
func TestStrictDecoding(t *testing.T) {
	var d appsv1.Deployment
	if err := strict("apiVersion: apps/v1\nkind: Deployment\nspec:\n  replica: 1\n", &d); err == nil {
		t.Error("unknown field accepted")
	}
	if err := strict("apiVersion: apps/v1\nkind: Deployment\nspec:\n  template:\n    spec:\n      containers:\n        - name: a\n          readinesProbe: {}\n", &d); err == nil {
		t.Error("unknown nested field accepted")
	}
	if err := strict("apiVersion: apps/v1\nkind: Deployment\nkind: Deployment\n", &d); err == nil {
		t.Error("duplicate field accepted")
	}
	if err := new(rendered).add("apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\n"); err == nil {
		t.Error("unknown kind accepted")
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
