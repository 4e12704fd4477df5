package helm

import (
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	credential "agentplane.dev/services/credential/server"
	ingest "agentplane.dev/services/ingest/server"
	sandbox "agentplane.dev/services/sandbox/server"
	session "agentplane.dev/services/session/server"
)

// loadConfig is each service's own configuration loader and validation,
// the code its binary runs first.
var loadConfig = map[string]func(args []string, lookupEnv func(string) (string, bool)) error{
	"session": func(a []string, l func(string) (string, bool)) error { _, err := session.LoadConfig(a, l); return err },
	"sandbox": func(a []string, l func(string) (string, bool)) error { _, err := sandbox.LoadConfig(a, l); return err },
	"credential": func(a []string, l func(string) (string, bool)) error {
		_, err := credential.LoadConfig(a, l)
		return err
	},
	"ingest": func(a []string, l func(string) (string, bool)) error { _, err := ingest.LoadConfig(a, l); return err },
}

// Every ci/ values file renders a configuration each service accepts: the
// container's environment is built the way the kubelet builds it (envFrom
// the ConfigMap, then env in order with $(VAR) references expanded, Secret
// keys filled with well-formed stand-ins) and handed to the service's own
// LoadConfig, with the container's arguments after the subcommand.
func TestRenderedConfigIsAccepted(t *testing.T) {
	for _, f := range ciFiles(t) {
		t.Run(filepath.Base(f), func(t *testing.T) {
			r, err := render(t, readValues(t, f))
			if err != nil {
				t.Fatalf("render: %v", err)
			}
			seen := 0
			for _, w := range r.workloads() {
				if w.component == "redis" {
					continue // the bundled try-out Redis, not an agentplane service
				}
				load, ok := loadConfig[w.component]
				if !ok {
					t.Fatalf("%s %s: no config loader for component %q", w.kind, w.name, w.component)
				}
				for _, c := range w.pod.Spec.Containers {
					if len(c.Args) < 2 || c.Args[0] != "serve" || c.Args[1] != w.component {
						t.Fatalf("%s: args %v do not start with the subcommand \"serve %s\"", w.name, c.Args, w.component)
					}
					env := podEnv(t, r, c)
					mountSecretStandIns(t, w.pod.Spec, c, env)
					if w.component == "sandbox" {
						// Owner leases name the pod's own address (owner-aware routing).
						want := fmt.Sprintf("10.1.2.3:%d", containerPort(c, "grpc"))
						if got := env["AGENTPLANE_SANDBOX_ADVERTISE_ADDR"]; got != want {
							t.Errorf("%s: AGENTPLANE_SANDBOX_ADVERTISE_ADDR = %q, want %q", w.name, got, want)
						}
					}
					if err := load(c.Args[2:], lookup(env)); err != nil {
						t.Errorf("%s: the service refuses the rendered configuration:\n%v", w.name, err)
					}
					seen++
				}
			}
			if seen != len(loadConfig) {
				t.Errorf("checked %d containers, want one per service (%d)", seen, len(loadConfig))
			}
		})
	}
}

// A refused setting in rendered values fails the check (the check can fail).
func TestRenderedConfigCheckCatchesBadAddress(t *testing.T) {
	vals := readValues(t, filepath.Join(chartDir, "ci", "ha-values.yaml"))
	sess, _ := vals["session"].(map[string]any)
	sess["extraEnv"] = []any{map[string]any{"name": "AGENTPLANE_SANDBOX_ADDR", "value": "a:1,,b:2"}}
	r, err := render(t, vals)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	for _, w := range r.workloads() {
		if w.component != "session" {
			continue
		}
		c := w.pod.Spec.Containers[0]
		env := podEnv(t, r, c)
		mountSecretStandIns(t, w.pod.Spec, c, env)
		err := loadConfig["session"](c.Args[2:], lookup(env))
		if err == nil || !strings.Contains(err.Error(), "AGENTPLANE_SANDBOX_ADDR") {
			t.Fatalf("want AGENTPLANE_SANDBOX_ADDR refused, got %v", err)
		}
		return
	}
	t.Fatal("no session workload rendered")
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// podEnv is the container's environment as the kubelet builds it.
func podEnv(t *testing.T, r *rendered, c corev1.Container) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, from := range c.EnvFrom {
		if from.ConfigMapRef == nil {
			t.Fatalf("%s: envFrom other than a ConfigMap is not modelled", c.Name)
		}
		cm := findConfigMap(r, from.ConfigMapRef.Name)
		if cm == nil {
			t.Fatalf("%s: envFrom ConfigMap %s not rendered", c.Name, from.ConfigMapRef.Name)
		}
		for k, v := range cm.Data {
			env[from.Prefix+k] = v
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = envRef.ReplaceAllStringFunc(e.Value, func(ref string) string {
				if v, ok := env[ref[2:len(ref)-1]]; ok {
					return v
				}
				return ref // the kubelet leaves unknown references as written
			})
		case e.ValueFrom.SecretKeyRef != nil:
			env[e.Name] = secretStandIn(e.Name)
		case e.ValueFrom.FieldRef != nil:
			env[e.Name] = fieldStandIn(t, e.ValueFrom.FieldRef.FieldPath)
		default:
			t.Fatalf("%s: env %s: valueFrom kind not modelled", c.Name, e.Name)
		}
	}
	return env
}

// mountSecretStandIns models the container's Secret volumes: each mounted
// key becomes a file with a well-formed stand-in under a temporary
// directory, and environment values naming a path under the mount point
// (AGENTPLANE_*_FILE) are pointed there.
func mountSecretStandIns(t *testing.T, pod corev1.PodSpec, c corev1.Container, env map[string]string) {
	t.Helper()
	for _, m := range c.VolumeMounts {
		var vol *corev1.Volume
		for i := range pod.Volumes {
			if pod.Volumes[i].Name == m.Name {
				vol = &pod.Volumes[i]
			}
		}
		if vol == nil || vol.Secret == nil {
			continue
		}
		dir := t.TempDir()
		for _, it := range vol.Secret.Items {
			if err := os.WriteFile(filepath.Join(dir, it.Path), []byte(secretFileStandIn(it.Path)), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		prefix := strings.TrimSuffix(m.MountPath, "/") + "/"
		for k, v := range env {
			if strings.HasPrefix(v, prefix) {
				env[k] = filepath.Join(dir, strings.TrimPrefix(v, prefix))
			}
		}
	}
}

func secretFileStandIn(path string) string {
	switch path {
	case "credential-key", "attestation-key":
		return base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))
	case "redis-password":
		return "redis-password"
	}
	return "stand-in-" + path
}

// secretStandIn is a well-formed value for a Secret-sourced variable.
func secretStandIn(name string) string {
	switch name {
	case "AGENTPLANE_CREDENTIAL_KEY", "AGENTPLANE_ATTESTATION_KEY":
		return base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))
	case "REDIS_PASSWORD":
		return "redis-password" // URL-safe, as the chart requires
	}
	return "stand-in-" + strings.ToLower(name)
}

func fieldStandIn(t *testing.T, path string) string {
	switch path {
	case "status.podIP":
		return "10.1.2.3"
	case "metadata.name":
		return "ap-sandbox-0"
	case "metadata.namespace":
		return namespace
	}
	t.Fatalf("fieldRef %s not modelled", path)
	return ""
}

func lookup(env map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := env[k]; return v, ok }
}

// The HA values make every service confirm its writes on one Redis replica;
// the defaults (a single Redis) wait for none.
func TestHAValuesWaitForOneReplica(t *testing.T) {
	for file, want := range map[string]string{"ha-values.yaml": "1", "default-values.yaml": "0"} {
		r, err := render(t, readValues(t, filepath.Join(chartDir, "ci", file)))
		if err != nil {
			t.Fatalf("render %s: %v", file, err)
		}
		seen := 0
		for _, w := range r.workloads() {
			env := podEnv(t, r, w.pod.Spec.Containers[0])
			if got := env["AGENTPLANE_REDIS_MIN_REPLICAS"]; got != want {
				t.Errorf("%s %s: AGENTPLANE_REDIS_MIN_REPLICAS=%q, want %q", file, w.component, got, want)
			}
			seen++
		}
		if seen == 0 {
			t.Fatalf("%s: no workload rendered", file)
		}
	}
}

// session.suspendAfter and suspendAfterProfiles reach the session service
// as its settings, which it accepts; a bad duration is refused by the schema.
func TestSuspendAfterValues(t *testing.T) {
	vals := readValues(t, filepath.Join(chartDir, "ci", "ha-values.yaml"))
	sess, _ := vals["session"].(map[string]any)
	sess["suspendAfter"] = "30s"
	sess["suspendAfterProfiles"] = map[string]any{"opencode": "5m", "kilo": "0"}
	r, err := render(t, vals)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	found := false
	for _, w := range r.workloads() {
		for _, c := range w.pod.Spec.Containers {
			env := podEnv(t, r, c)
			if w.component != "session" {
				if _, ok := env["AGENTPLANE_SESSION_SUSPEND_AFTER"]; ok {
					t.Errorf("%s: AGENTPLANE_SESSION_SUSPEND_AFTER set", w.component)
				}
				continue
			}
			found = true
			if got := env["AGENTPLANE_SESSION_SUSPEND_AFTER"]; got != "30s" {
				t.Errorf("AGENTPLANE_SESSION_SUSPEND_AFTER = %q, want 30s", got)
			}
			if got := env["AGENTPLANE_SESSION_SUSPEND_AFTER_PROFILES"]; got != "kilo=0,opencode=5m" {
				t.Errorf("AGENTPLANE_SESSION_SUSPEND_AFTER_PROFILES = %q, want kilo=0,opencode=5m", got)
			}
			mountSecretStandIns(t, w.pod.Spec, c, env)
			if err := loadConfig["session"](c.Args[2:], lookup(env)); err != nil {
				t.Errorf("the session service refuses the rendered configuration: %v", err)
			}
		}
	}
	if !found {
		t.Fatal("no session container")
	}
	sess["suspendAfter"] = "soon"
	if _, err := render(t, vals); err == nil || !strings.Contains(err.Error(), "suspendAfter") {
		t.Fatalf("want a schema error on session.suspendAfter, got %v", err)
	}
}

// session.priceTable reaches the session service as its price table, which
// it accepts; a negative price is refused by the schema.
func TestPriceTableValue(t *testing.T) {
	vals := readValues(t, filepath.Join(chartDir, "ci", "ha-values.yaml"))
	sess, _ := vals["session"].(map[string]any)
	sess["priceTable"] = map[string]any{"gpt-4o": map[string]any{"input": 2.5, "output": 10, "cached": 1.25}, "*": map[string]any{"input": 1, "output": 2}}
	env := acceptedEnv(t, vals, "session")
	want := `{"*":{"input":1,"output":2},"gpt-4o":{"cached":1.25,"input":2.5,"output":10}}`
	if got := env["AGENTPLANE_SESSION_PRICE_TABLE"]; got != want {
		t.Errorf("AGENTPLANE_SESSION_PRICE_TABLE = %q, want %q", got, want)
	}
	sess["priceTable"] = map[string]any{"m": map[string]any{"input": -1}}
	if _, err := render(t, vals); err == nil || !strings.Contains(err.Error(), "priceTable") {
		t.Fatalf("want a schema error on session.priceTable, got %v", err)
	}
}

// sandbox.egress.expectedDenials reaches the sandbox service as its profiles'
// expected denials, which it accepts; a host that is not a name is refused by
// the schema.
func TestExpectedDenialsValue(t *testing.T) {
	vals := readValues(t, filepath.Join(chartDir, "ci", "ha-values.yaml"))
	sbx, _ := vals["sandbox"].(map[string]any)
	egress, _ := sbx["egress"].(map[string]any)
	if egress == nil {
		egress = map[string]any{}
		sbx["egress"] = egress
	}
	egress["expectedDenials"] = map[string]any{"kilo": []any{"us.i.posthog.com"}, "opencode": []any{"*.sentry.io", "telemetry.example"}}
	env := acceptedEnv(t, vals, "sandbox")
	want := "kilo=us.i.posthog.com,opencode=*.sentry.io|telemetry.example"
	if got := env["AGENTPLANE_AGENT_EXPECTED_DENIALS"]; got != want {
		t.Errorf("AGENTPLANE_AGENT_EXPECTED_DENIALS = %q, want %q", got, want)
	}
	egress["expectedDenials"] = map[string]any{"kilo": []any{"Bad Host"}}
	if _, err := render(t, vals); err == nil || !strings.Contains(err.Error(), "expectedDenials") {
		t.Fatalf("want a schema error on sandbox.egress.expectedDenials, got %v", err)
	}
}

// TestPoolValues: sandbox.pool renders AGENTPLANE_SANDBOX_POOL and its
// directory, which the sandbox service accepts; a bad size is a schema error.
func TestPoolValues(t *testing.T) {
	vals := readValues(t, filepath.Join(chartDir, "ci", "ha-values.yaml"))
	sbx, _ := vals["sandbox"].(map[string]any)
	sbx["pool"] = map[string]any{"sizes": map[string]any{"scripted": 2}, "directory": "/work"}
	env := acceptedEnv(t, vals, "sandbox")
	if got := env["AGENTPLANE_SANDBOX_POOL"]; got != "scripted=2" {
		t.Errorf("AGENTPLANE_SANDBOX_POOL = %q", got)
	}
	if got := env["AGENTPLANE_SANDBOX_POOL_DIRECTORY"]; got != "/work" {
		t.Errorf("AGENTPLANE_SANDBOX_POOL_DIRECTORY = %q", got)
	}
	sbx["pool"] = map[string]any{"sizes": map[string]any{"opencode": 65}}
	if _, err := render(t, vals); err == nil || !strings.Contains(err.Error(), "pool") {
		t.Fatalf("want a schema error on sandbox.pool.sizes, got %v", err)
	}
}

// acceptedEnv renders vals and returns the environment of component's
// container, failing unless the service accepts that configuration.
func acceptedEnv(t *testing.T, vals map[string]any, component string) map[string]string {
	t.Helper()
	r, err := render(t, vals)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	for _, w := range r.workloads() {
		if w.component != component {
			continue
		}
		c := w.pod.Spec.Containers[0]
		env := podEnv(t, r, c)
		mountSecretStandIns(t, w.pod.Spec, c, env)
		if err := loadConfig[component](c.Args[2:], lookup(env)); err != nil {
			t.Fatalf("the %s service refuses the rendered configuration: %v", component, err)
		}
		return env
	}
	t.Fatalf("no %s workload rendered", component)
	return nil
}
