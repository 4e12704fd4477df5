package helm

import (
	"path"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chartutil"
	corev1 "k8s.io/api/core/v1"
)

// secretSettings are the agentplane settings that hold secrets: each must reach a service as
// its _FILE form, never as the value.
var secretSettings = []string{"AGENTPLANE_INTERNAL_TOKEN", "AGENTPLANE_REDIS_PASSWORD", "AGENTPLANE_CREDENTIAL_KEY", "AGENTPLANE_ATTESTATION_KEY"}

// checkSecretsAsFiles: no container takes a Secret through its environment (no secretKeyRef,
// no envFrom of a Secret, no value of a rendered Secret in an env value, argument or the
// ConfigMap); every service is given each secret it needs as an AGENTPLANE_*_FILE path that
// lies in a read-only mount of a Secret volume holding that key; only the credential service
// gets the credential and attestation keys.
func checkSecretsAsFiles(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	var values []string
	for _, s := range r.secrets {
		for _, b := range s.Data {
			if len(b) >= 8 {
				values = append(values, string(b))
			}
		}
	}
	leaks := func(where, text string) {
		for _, val := range values {
			if strings.Contains(text, val) {
				t.Errorf("%s carries a Secret value", where)
			}
		}
	}
	for k, val := range configData(t, r) {
		leaks("ConfigMap key "+k, val)
	}
	pw, _ := v.PathValue("redis.password")
	usePw, _ := v.PathValue("redis.usePassword")
	bundled, _ := v.PathValue("redis.bundled.enabled")
	redisPassword := pw != "" || usePw == true || bundled == true
	keys := func(name string) string {
		k, _ := v.PathValue("secrets.keys." + name)
		return k.(string)
	}
	for _, w := range r.workloads() {
		for _, c := range w.pod.Spec.Containers {
			where := w.component + "/" + c.Name
			for _, ef := range c.EnvFrom {
				if ef.SecretRef != nil {
					t.Errorf("%s: envFrom Secret %s", where, ef.SecretRef.Name)
				}
			}
			for _, e := range c.Env {
				if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
					t.Errorf("%s: env %s comes from Secret %s: secrets are files", where, e.Name, e.ValueFrom.SecretKeyRef.Name)
				}
				if contains(secretSettings, e.Name) {
					t.Errorf("%s: env %s is a secret's value form", where, e.Name)
				}
				leaks(where+" env "+e.Name, e.Value)
			}
			leaks(where+" command and args", strings.Join(append(append([]string{}, c.Command...), c.Args...), " "))
			if w.component == "redis" {
				continue
			}
			want := map[string]string{"AGENTPLANE_INTERNAL_TOKEN_FILE": keys("internalToken")}
			if redisPassword {
				want["AGENTPLANE_REDIS_PASSWORD_FILE"] = keys("redisPassword")
			}
			if w.component == "credential" {
				want["AGENTPLANE_CREDENTIAL_KEY_FILE"] = keys("credentialKey")
				want["AGENTPLANE_ATTESTATION_KEY_FILE"] = keys("attestationKey")
			}
			for env, key := range want {
				p := envValue(c, env)
				if p == "" {
					t.Errorf("%s: %s not set", where, env)
					continue
				}
				if got, ok := secretKeyAt(w.pod.Spec, c, p); !ok || got != key {
					t.Errorf("%s: %s = %q is not Secret key %q in a read-only Secret mount (got %q)", where, env, p, key, got)
				}
			}
			for _, e := range c.Env {
				if strings.HasSuffix(e.Name, "_FILE") && want[e.Name] == "" {
					t.Errorf("%s: %s is set but the service has no need of it", where, e.Name)
				}
			}
			for _, vol := range w.pod.Spec.Volumes {
				if vol.Secret == nil {
					continue
				}
				if len(vol.Secret.Items) == 0 {
					t.Errorf("%s: volume %s mounts every key of Secret %s", where, vol.Name, vol.Secret.SecretName)
				}
				for _, it := range vol.Secret.Items {
					if w.component != "credential" && (it.Key == keys("credentialKey") || it.Key == keys("attestationKey")) {
						t.Errorf("%s: mounts the credential service's key %q", where, it.Key)
					}
				}
			}
		}
	}
}

// secretKeyAt returns the Secret key that file p is, in container c of pod spec.
func secretKeyAt(spec corev1.PodSpec, c corev1.Container, p string) (string, bool) {
	for _, m := range c.VolumeMounts {
		rel := strings.TrimPrefix(p, strings.TrimSuffix(m.MountPath, "/")+"/")
		if rel == p || !m.ReadOnly {
			continue
		}
		for _, vol := range spec.Volumes {
			if vol.Name != m.Name || vol.Secret == nil {
				continue
			}
			for _, it := range vol.Secret.Items {
				if path.Clean(it.Path) == rel {
					return it.Key, true
				}
			}
		}
	}
	return "", false
}

// checkIsolation: the sandbox container is told sandbox.isolation; with namespaces its pod
// runs in its own user namespace, with an unmasked /proc and the seccomp and AppArmor
// profiles of sandbox.namespaces (still unprivileged); with none it gets none of that and
// NOTES.txt warns. No other workload ever gets these relaxations.
func checkIsolation(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	isolation, _ := v.PathValue("sandbox.isolation")
	for _, w := range r.workloads() {
		spec := w.pod.Spec
		c := spec.Containers[0]
		sc := c.SecurityContext
		if sc == nil {
			sc = &corev1.SecurityContext{}
		}
		ownUserNS := spec.HostUsers != nil && !*spec.HostUsers
		unmasked := sc.ProcMount != nil && *sc.ProcMount == corev1.UnmaskedProcMount
		seccomp, apparmor := "", ""
		if sc.SeccompProfile != nil {
			seccomp = string(sc.SeccompProfile.Type)
		}
		if sc.AppArmorProfile != nil {
			apparmor = string(sc.AppArmorProfile.Type)
		}
		if w.component != "sandbox" || isolation != "namespaces" {
			if ownUserNS || unmasked || seccomp == "Unconfined" || apparmor == "Unconfined" {
				t.Errorf("%s: hostUsers false %v, procMount Unmasked %v, seccomp %q, AppArmor %q: not asked for", w.component, ownUserNS, unmasked, seccomp, apparmor)
			}
			if w.component == "sandbox" && envValue(c, "AGENTPLANE_SANDBOX_ISOLATION") != "none" {
				t.Errorf("sandbox: AGENTPLANE_SANDBOX_ISOLATION = %q, values say %v", envValue(c, "AGENTPLANE_SANDBOX_ISOLATION"), isolation)
			}
			if w.component != "sandbox" && envValue(c, "AGENTPLANE_SANDBOX_ISOLATION") != "" {
				t.Errorf("%s: AGENTPLANE_SANDBOX_ISOLATION set", w.component)
			}
			continue
		}
		if got := envValue(c, "AGENTPLANE_SANDBOX_ISOLATION"); got != "namespaces" {
			t.Errorf("sandbox: AGENTPLANE_SANDBOX_ISOLATION = %q, want namespaces", got)
		}
		if !ownUserNS || !unmasked {
			t.Errorf("sandbox: isolation=namespaces needs hostUsers: false (got %v) and procMount: Unmasked (got %v)", spec.HostUsers, sc.ProcMount)
		}
		wantSeccomp, _ := v.PathValue("sandbox.namespaces.seccompProfile.type")
		wantAppArmor, _ := v.PathValue("sandbox.namespaces.appArmorProfile.type")
		if seccomp != wantSeccomp || apparmor != wantAppArmor {
			t.Errorf("sandbox: seccomp %q AppArmor %q, values say %v %v", seccomp, apparmor, wantSeccomp, wantAppArmor)
		}
		if p, _ := v.PathValue("sandbox.namespaces.seccompProfile.localhostProfile"); p != nil && (sc.SeccompProfile.LocalhostProfile == nil || *sc.SeccompProfile.LocalhostProfile != p) {
			t.Errorf("sandbox: seccomp localhostProfile %v, values say %v", sc.SeccompProfile.LocalhostProfile, p)
		}
		if sc.Privileged != nil && *sc.Privileged || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
			sc.Capabilities == nil || len(sc.Capabilities.Add) > 0 || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Errorf("sandbox: isolation must not cost privilege: %+v", sc)
		}
	}
	warned := strings.Contains(r.notes, "WARNING: sandbox.isolation=none")
	if warned != (isolation == "none") {
		t.Errorf("NOTES.txt warns about isolation=none: %v, isolation is %v", warned, isolation)
	}
}
