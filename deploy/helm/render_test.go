package helm

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

const (
	chartDir    = "agentplane"
	releaseName = "ap"
	namespace   = "agentplane"
	kubeVersion = "v1.33.0"
)

// The four services and the (Deployment or StatefulSet) kind each runs as.
var components = map[string]string{
	"session":    "Deployment",
	"sandbox":    "StatefulSet",
	"credential": "Deployment",
	"ingest":     "Deployment",
}

// rendered is one release rendered by the Helm SDK and strictly decoded.
type rendered struct {
	notes           string
	deployments     []*appsv1.Deployment
	statefulSets    []*appsv1.StatefulSet
	services        []*corev1.Service
	configMaps      []*corev1.ConfigMap
	secrets         []*corev1.Secret
	serviceAccounts []*corev1.ServiceAccount
	pdbs            []*policyv1.PodDisruptionBudget
	netpols         []*networkingv1.NetworkPolicy
	serviceMonitors []*monitoringv1.ServiceMonitor
	prometheusRules []*monitoringv1.PrometheusRule
}

// workload is a pod template with its owner, for checks that apply to both kinds.
type workload struct {
	kind, name, component string
	replicas              int32
	selector              *metav1.LabelSelector
	pod                   corev1.PodTemplateSpec
}

func (r *rendered) workloads() []workload {
	var out []workload
	for _, d := range r.deployments {
		out = append(out, workload{"Deployment", d.Name, d.Spec.Template.Labels["app.kubernetes.io/component"], replicas(d.Spec.Replicas), d.Spec.Selector, d.Spec.Template})
	}
	for _, s := range r.statefulSets {
		out = append(out, workload{"StatefulSet", s.Name, s.Spec.Template.Labels["app.kubernetes.io/component"], replicas(s.Spec.Replicas), s.Spec.Selector, s.Spec.Template})
	}
	return out
}

func replicas(p *int32) int32 {
	if p == nil {
		return 1
	}
	return *p
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load chart: %v", err)
	}
	return c
}

// render runs `helm install --dry-run` (client only) with the Helm SDK, which validates the
// values against values.schema.json, renders every template and NOTES.txt.
func render(t *testing.T, vals map[string]any) (*rendered, error) {
	t.Helper()
	kv, err := chartutil.ParseKubeVersion(kubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun = true
	inst.ClientOnly = true
	inst.Replace = true
	inst.ReleaseName = releaseName
	inst.Namespace = namespace
	inst.KubeVersion = kv
	inst.APIVersions = chartutil.VersionSet{"monitoring.coreos.com/v1"}
	rel, err := inst.Run(loadChart(t), vals)
	if err != nil {
		return nil, err
	}
	r := &rendered{notes: rel.Info.Notes}
	docs := releaseutil.SplitManifests(rel.Manifest)
	keys := make([]string, 0, len(docs))
	for k := range docs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if err := r.add(docs[k]); err != nil {
			t.Fatalf("manifest %s: %v\n%s", k, err, docs[k])
		}
	}
	return r, nil
}

// strict decodes YAML into out, rejecting unknown and duplicate fields.
func strict(doc string, out any) error { return yaml.UnmarshalStrict([]byte(doc), out) }

func (r *rendered) add(doc string) error {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
		return err
	}
	if tm.Kind == "" && strings.TrimSpace(stripComments(doc)) == "" {
		return nil
	}
	gvk := tm.APIVersion + "/" + tm.Kind
	switch gvk {
	case "apps/v1/Deployment":
		return decodeInto(doc, &r.deployments)
	case "apps/v1/StatefulSet":
		return decodeInto(doc, &r.statefulSets)
	case "v1/Service":
		return decodeInto(doc, &r.services)
	case "v1/ConfigMap":
		return decodeInto(doc, &r.configMaps)
	case "v1/Secret":
		return decodeInto(doc, &r.secrets)
	case "v1/ServiceAccount":
		return decodeInto(doc, &r.serviceAccounts)
	case "policy/v1/PodDisruptionBudget":
		return decodeInto(doc, &r.pdbs)
	case "networking.k8s.io/v1/NetworkPolicy":
		return decodeInto(doc, &r.netpols)
	case "monitoring.coreos.com/v1/ServiceMonitor":
		return decodeInto(doc, &r.serviceMonitors)
	case "monitoring.coreos.com/v1/PrometheusRule":
		return decodeInto(doc, &r.prometheusRules)
	}
	return fmt.Errorf("unexpected kind %q (the test must learn every kind the chart renders)", gvk)
}

func decodeInto[T any](doc string, list *[]*T) error {
	v := new(T)
	if err := strict(doc, v); err != nil {
		return fmt.Errorf("strict decode: %w", err)
	}
	*list = append(*list, v)
	return nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

func ciFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 3 {
		t.Fatalf("want at least the default, ha and minimal values files in ci/, found %v", files)
	}
	return files
}

func readValues(t *testing.T, path string) map[string]any {
	t.Helper()
	v, err := chartutil.ReadValuesFile(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return v.AsMap()
}

// valuesOf returns the chart defaults coalesced with vals, as the templates see them.
func valuesOf(t *testing.T, vals map[string]any) chartutil.Values {
	t.Helper()
	v, err := chartutil.CoalesceValues(loadChart(t), vals)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestRenderCIValues(t *testing.T) {
	for _, f := range ciFiles(t) {
		t.Run(filepath.Base(f), func(t *testing.T) {
			vals := readValues(t, f)
			r, err := render(t, vals)
			if err != nil {
				t.Fatalf("render: %v", err)
			}
			checkAll(t, r, valuesOf(t, vals))
		})
	}
}

// checkAll asserts every invariant of the chart on one rendered release.
func checkAll(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	checkWorkloads(t, r, v)
	checkProbes(t, r)
	checkGracePeriod(t, r)
	checkPDBs(t, r, v)
	checkServices(t, r)
	checkServiceMonitors(t, r, v)
	checkPrometheusRule(t, r, v)
	checkDashboard(t, r, v)
	checkPrivileged(t, r, nil)
	checkReferences(t, r, v)
	checkNetworkPolicies(t, r, v)
	checkNotes(t, r)
	checkSecretsAsFiles(t, r, v)
	checkIsolation(t, r, v)
}

func checkWorkloads(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	seen := map[string]bool{}
	image := ""
	for _, w := range r.workloads() {
		if w.component == "redis" {
			if b, _ := v.PathValue("redis.bundled.enabled"); b != true {
				t.Errorf("%s %s rendered without redis.bundled.enabled", w.kind, w.name)
			}
			continue
		}
		want, ok := components[w.component]
		if !ok {
			t.Errorf("%s %s has unknown component %q", w.kind, w.name, w.component)
			continue
		}
		if want != w.kind {
			t.Errorf("%s runs as %s, want %s", w.component, w.kind, want)
		}
		seen[w.component] = true
		sel, err := metav1.LabelSelectorAsSelector(w.selector)
		if err != nil || sel.Empty() || !sel.Matches(labels.Set(w.pod.Labels)) {
			t.Errorf("%s %s: selector %v does not select its own pod labels %v (%v)", w.kind, w.name, w.selector, w.pod.Labels, err)
		}
		if n, _ := v.PathValue(w.component + ".replicas"); fmt.Sprint(n) != fmt.Sprint(w.replicas) {
			t.Errorf("%s replicas = %d, values say %v", w.component, w.replicas, n)
		}
		if len(w.pod.Spec.Containers) != 1 {
			t.Fatalf("%s: want exactly one container, got %d", w.name, len(w.pod.Spec.Containers))
		}
		c := w.pod.Spec.Containers[0]
		if image == "" {
			image = c.Image
		} else if c.Image != image {
			t.Errorf("%s uses image %q, others %q: the chart ships one all-in-one image", w.component, c.Image, image)
		}
		if len(c.Args) != 2 || c.Args[0] != "serve" || c.Args[1] != w.component {
			t.Errorf("%s: args = %v, want [serve %s] (the agentplane subcommand)", w.component, c.Args, w.component)
		}
		grpcPort := containerPort(c, "grpc")
		if got := envValue(c, "AGENTPLANE_GRPC_ADDR"); got != fmt.Sprintf(":%d", grpcPort) {
			t.Errorf("%s: AGENTPLANE_GRPC_ADDR = %q, grpc port %d", w.component, got, grpcPort)
		}
		if got := envValue(c, "AGENTPLANE_METRICS_ADDR"); got != fmt.Sprintf(":%d", containerPort(c, "metrics")) {
			t.Errorf("%s: AGENTPLANE_METRICS_ADDR = %q", w.component, got)
		}
		if w.component == "credential" {
			if got := envValue(c, "AGENTPLANE_PROXY_ADDR"); got != fmt.Sprintf(":%d", containerPort(c, "proxy")) || got == ":0" {
				t.Errorf("credential: AGENTPLANE_PROXY_ADDR = %q, proxy port %d", got, containerPort(c, "proxy"))
			}
		}
		if w.component == "sandbox" {
			root := envValue(c, "AGENTPLANE_SANDBOX_ROOT")
			mounted := false
			for _, m := range c.VolumeMounts {
				if m.MountPath == root && !m.ReadOnly {
					mounted = true
				}
			}
			if root == "" || !mounted {
				t.Errorf("sandbox: AGENTPLANE_SANDBOX_ROOT %q is not a writable volume mount", root)
			}
		}
		checkRedisEnv(t, w.component, c)
		if w.pod.Spec.SecurityContext == nil || w.pod.Spec.SecurityContext.RunAsNonRoot == nil || !*w.pod.Spec.SecurityContext.RunAsNonRoot {
			t.Errorf("%s: pod must run as non-root", w.component)
		}
		if w.pod.Spec.HostPID || w.pod.Spec.HostNetwork || w.pod.Spec.HostIPC {
			t.Errorf("%s: pod uses a host namespace", w.component)
		}
	}
	for comp := range components {
		if !seen[comp] {
			t.Errorf("no workload for %s", comp)
		}
	}
}

// checkRedisEnv: AGENTPLANE_REDIS_URL is set and carries no password (that is a file).
func checkRedisEnv(t *testing.T, component string, c corev1.Container) {
	t.Helper()
	url := envValue(c, "AGENTPLANE_REDIS_URL")
	if url == "" || !strings.Contains(url, "://") {
		t.Errorf("%s: AGENTPLANE_REDIS_URL = %q", component, url)
	}
	if strings.Contains(url, "$(") {
		t.Errorf("%s: AGENTPLANE_REDIS_URL %q expands an environment variable", component, url)
	}
}

func containerPort(c corev1.Container, name string) int32 {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	return 0
}

func envValue(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

func checkProbes(t *testing.T, r *rendered) {
	t.Helper()
	for _, w := range r.workloads() {
		if w.component == "redis" {
			continue
		}
		c := w.pod.Spec.Containers[0]
		grpcPort := containerPort(c, "grpc")
		if grpcPort == 0 {
			t.Errorf("%s: no container port named grpc", w.component)
			continue
		}
		for _, p := range []struct {
			kind    string
			probe   *corev1.Probe
			service string
		}{
			{"readiness", c.ReadinessProbe, ""},
			{"liveness", c.LivenessProbe, "liveness"},
			{"startup", c.StartupProbe, "liveness"},
		} {
			if p.probe == nil || p.probe.GRPC == nil {
				t.Errorf("%s: %s probe is not a native gRPC probe: %+v", w.component, p.kind, p.probe)
				continue
			}
			if p.probe.GRPC.Port != grpcPort {
				t.Errorf("%s: %s probe port %d, grpc port %d", w.component, p.kind, p.probe.GRPC.Port, grpcPort)
			}
			got := ""
			if p.probe.GRPC.Service != nil {
				got = *p.probe.GRPC.Service
			}
			if got != p.service {
				t.Errorf("%s: %s probe asks health service %q, want %q", w.component, p.kind, got, p.service)
			}
		}
		if s := c.StartupProbe; s != nil && s.PeriodSeconds*s.FailureThreshold < 30 {
			t.Errorf("%s: startup probe allows only %ds", w.component, s.PeriodSeconds*s.FailureThreshold)
		}
	}
}

func configData(t *testing.T, r *rendered) map[string]string {
	t.Helper()
	for _, cm := range r.configMaps {
		if strings.HasSuffix(cm.Name, "-config") {
			return cm.Data
		}
	}
	t.Fatal("no -config ConfigMap rendered")
	return nil
}

func checkGracePeriod(t *testing.T, r *rendered) {
	t.Helper()
	cfg := configData(t, r)
	drain, err1 := time.ParseDuration(cfg["AGENTPLANE_DRAIN_DELAY"])
	stop, err2 := time.ParseDuration(cfg["AGENTPLANE_SHUTDOWN_TIMEOUT"])
	if err1 != nil || err2 != nil {
		t.Fatalf("drain %q / shutdown %q do not parse: %v %v", cfg["AGENTPLANE_DRAIN_DELAY"], cfg["AGENTPLANE_SHUTDOWN_TIMEOUT"], err1, err2)
	}
	for _, w := range r.workloads() {
		if w.component == "redis" {
			continue
		}
		g := w.pod.Spec.TerminationGracePeriodSeconds
		if g == nil || time.Duration(*g)*time.Second <= drain+stop {
			t.Errorf("%s: terminationGracePeriodSeconds %v is not longer than drain %v + graceful stop %v", w.component, g, drain, stop)
		}
	}
}

func selects(sel *metav1.LabelSelector, podLabels map[string]string) bool {
	s, err := metav1.LabelSelectorAsSelector(sel)
	return err == nil && !s.Empty() && s.Matches(labels.Set(podLabels))
}

func checkPDBs(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	enabled, _ := v.PathValue("podDisruptionBudget.enabled")
	for _, w := range r.workloads() {
		var matching []string
		for _, p := range r.pdbs {
			if selects(p.Spec.Selector, w.pod.Labels) {
				matching = append(matching, p.Name)
			}
		}
		want := 0
		if w.replicas > 1 && enabled == true {
			want = 1
		}
		if len(matching) != want {
			t.Errorf("%s (replicas %d): %d PodDisruptionBudgets %v, want %d", w.name, w.replicas, len(matching), matching, want)
		}
	}
	for _, p := range r.pdbs {
		n := 0
		for _, w := range r.workloads() {
			if selects(p.Spec.Selector, w.pod.Labels) {
				n++
			}
		}
		if n != 1 {
			t.Errorf("PDB %s selects %d workloads, want 1", p.Name, n)
		}
	}
}

func checkServices(t *testing.T, r *rendered) {
	t.Helper()
	for _, s := range r.services {
		if len(s.Spec.Selector) == 0 {
			t.Errorf("Service %s has no selector", s.Name)
			continue
		}
		var matched []workload
		for _, w := range r.workloads() {
			if labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(w.pod.Labels)) {
				matched = append(matched, w)
			}
		}
		if len(matched) != 1 {
			t.Errorf("Service %s selector %v matches %d workloads' pods, want exactly 1", s.Name, s.Spec.Selector, len(matched))
			continue
		}
		w := matched[0]
		if comp := s.Labels["app.kubernetes.io/component"]; comp != w.component {
			t.Errorf("Service %s is labelled %q but selects %s pods", s.Name, comp, w.component)
		}
		c := w.pod.Spec.Containers[0]
		for _, p := range s.Spec.Ports {
			target := p.TargetPort.String()
			if p.TargetPort.StrVal == "" || containerPort(c, target) == 0 {
				t.Errorf("Service %s port %s targets %q, not a named port of %s", s.Name, p.Name, target, w.name)
			}
			if p.Name == "grpc" && (p.AppProtocol == nil || *p.AppProtocol != "grpc") {
				t.Errorf("Service %s: grpc port lacks appProtocol: grpc", s.Name)
			}
		}
		if _, ok := components[w.component]; ok && s.Labels["agentplane.dev/service-kind"] != "proxy" {
			hasGRPC := false
			for _, p := range s.Spec.Ports {
				hasGRPC = hasGRPC || p.Name == "grpc"
			}
			if !hasGRPC {
				t.Errorf("Service %s has no port named grpc", s.Name)
			}
		}
	}
	for _, st := range r.statefulSets {
		found := false
		for _, s := range r.services {
			if s.Name == st.Spec.ServiceName {
				found = s.Spec.ClusterIP == corev1.ClusterIPNone
			}
		}
		if !found {
			t.Errorf("StatefulSet %s: governing Service %q missing or not headless", st.Name, st.Spec.ServiceName)
		}
	}
	for comp := range components {
		if svcFor(r, comp, "main") == nil {
			t.Errorf("no main Service for %s", comp)
		}
	}
	if svcFor(r, "credential", "proxy") == nil {
		t.Error("no Service for the credential proxy")
	}
}

func svcFor(r *rendered, component, kind string) *corev1.Service {
	for _, s := range r.services {
		if s.Labels["app.kubernetes.io/component"] == component && s.Labels["agentplane.dev/service-kind"] == kind {
			return s
		}
	}
	return nil
}

func checkServiceMonitors(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	enabled, _ := v.PathValue("serviceMonitor.enabled")
	if enabled == true && len(r.serviceMonitors) != len(components) {
		t.Errorf("serviceMonitor.enabled: %d ServiceMonitors, want %d", len(r.serviceMonitors), len(components))
	}
	if enabled != true && len(r.serviceMonitors) != 0 {
		t.Errorf("serviceMonitor disabled but %d rendered", len(r.serviceMonitors))
	}
	for _, sm := range r.serviceMonitors {
		if !sm.Spec.NamespaceSelector.Any && len(sm.Spec.NamespaceSelector.MatchNames) > 0 && !contains(sm.Spec.NamespaceSelector.MatchNames, namespace) {
			t.Errorf("ServiceMonitor %s does not look in the release namespace", sm.Name)
		}
		var selected []*corev1.Service
		for _, s := range r.services {
			if selects(&sm.Spec.Selector, s.Labels) {
				selected = append(selected, s)
			}
		}
		if len(selected) == 0 {
			t.Errorf("ServiceMonitor %s selects no Service", sm.Name)
		}
		if len(sm.Spec.Endpoints) == 0 {
			t.Errorf("ServiceMonitor %s has no endpoints", sm.Name)
		}
		for _, s := range selected {
			for _, ep := range sm.Spec.Endpoints {
				if ep.Port == "" || !servicePortNamed(s, ep.Port) {
					t.Errorf("ServiceMonitor %s endpoint port %q does not exist on Service %s", sm.Name, ep.Port, s.Name)
				}
			}
		}
	}
}

func servicePortNamed(s *corev1.Service, name string) bool {
	for _, p := range s.Spec.Ports {
		if p.Name == name {
			return true
		}
	}
	return false
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// checkPrivileged fails on any privileged or escalating container, except the components
// listed in allowed (whose values asked for it).
func checkPrivileged(t *testing.T, r *rendered, allowed map[string]bool) {
	t.Helper()
	for _, w := range r.workloads() {
		for _, c := range append(append([]corev1.Container{}, w.pod.Spec.InitContainers...), w.pod.Spec.Containers...) {
			sc := c.SecurityContext
			priv := sc != nil && sc.Privileged != nil && *sc.Privileged
			if priv != allowed[w.component] {
				t.Errorf("%s/%s: privileged = %v, values ask for %v", w.component, c.Name, priv, allowed[w.component])
			}
			if allowed[w.component] {
				continue
			}
			if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s/%s: allowPrivilegeEscalation must be false", w.component, c.Name)
			}
			if sc != nil && sc.Capabilities != nil && (len(sc.Capabilities.Add) > 0 || !contains(capStrings(sc.Capabilities.Drop), "ALL")) {
				t.Errorf("%s/%s: capabilities %+v, want drop ALL and add none", w.component, c.Name, sc.Capabilities)
			}
		}
	}
}

func capStrings(cs []corev1.Capability) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = string(c)
	}
	return out
}

// checkReferences: every ConfigMap, Secret and ServiceAccount a pod names is rendered (or is
// the existing Secret the values name), with the keys it reads.
func checkReferences(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	existing, _ := v.PathValue("secrets.existingSecret")
	for _, w := range r.workloads() {
		spec := w.pod.Spec
		if w.component != "redis" {
			found := false
			for _, sa := range r.serviceAccounts {
				found = found || sa.Name == spec.ServiceAccountName
			}
			if !found {
				t.Errorf("%s: ServiceAccount %q not rendered", w.component, spec.ServiceAccountName)
			}
		}
		for _, c := range spec.Containers {
			for _, ef := range c.EnvFrom {
				if ef.ConfigMapRef != nil && findConfigMap(r, ef.ConfigMapRef.Name) == nil {
					t.Errorf("%s: envFrom ConfigMap %q not rendered", w.component, ef.ConfigMapRef.Name)
				}
			}
			for _, vol := range spec.Volumes {
				if vol.Secret == nil || (existing != nil && existing != "" && vol.Secret.SecretName == existing) {
					continue
				}
				s := findSecret(r, vol.Secret.SecretName)
				if s == nil {
					t.Errorf("%s: volume %s mounts Secret %q, not rendered", w.component, vol.Name, vol.Secret.SecretName)
					continue
				}
				for _, it := range vol.Secret.Items {
					if _, ok := s.Data[it.Key]; !ok {
						t.Errorf("%s: volume %s mounts key %q missing from Secret %s", w.component, vol.Name, it.Key, s.Name)
					}
				}
			}
			for _, e := range c.Env {
				ref := e.ValueFrom
				if ref == nil || ref.SecretKeyRef == nil {
					continue
				}
				name, key := ref.SecretKeyRef.Name, ref.SecretKeyRef.Key
				if existing != nil && existing != "" && name == existing {
					continue
				}
				s := findSecret(r, name)
				if s == nil {
					t.Errorf("%s: env %s reads Secret %q, not rendered", w.component, e.Name, name)
					continue
				}
				if _, ok := s.Data[key]; !ok && (ref.SecretKeyRef.Optional == nil || !*ref.SecretKeyRef.Optional) {
					t.Errorf("%s: env %s reads key %q missing from Secret %s", w.component, e.Name, key, name)
				}
			}
		}
	}
	if existing != nil && existing != "" && len(r.secrets) != 0 {
		t.Errorf("secrets.existingSecret is set but the chart renders %d Secrets", len(r.secrets))
	}
	cfg := configData(t, r)
	for _, k := range []string{"AGENTPLANE_SESSION_ADDR", "AGENTPLANE_SANDBOX_ADDR", "AGENTPLANE_CREDENTIAL_ADDR", "AGENTPLANE_INGEST_ADDR", "AGENTPLANE_LOG_LEVEL", "AGENTPLANE_LOG_FORMAT"} {
		if cfg[k] == "" {
			t.Errorf("ConfigMap lacks %s", k)
		}
	}
	for comp := range components {
		addr := cfg["AGENTPLANE_"+strings.ToUpper(comp)+"_ADDR"]
		svc := svcFor(r, comp, "main")
		if svc == nil {
			continue
		}
		var grpcPort int32
		for _, p := range svc.Spec.Ports {
			if p.Name == "grpc" {
				grpcPort = p.Port
			}
		}
		if !strings.HasSuffix(addr, fmt.Sprintf(":%d", grpcPort)) || !strings.Contains(addr, svc.Name) {
			t.Errorf("%s peer address %q does not name Service %s port %d", comp, addr, svc.Name, grpcPort)
		}
	}
}

func findConfigMap(r *rendered, name string) *corev1.ConfigMap {
	for _, c := range r.configMaps {
		if c.Name == name {
			return c
		}
	}
	return nil
}

func findSecret(r *rendered, name string) *corev1.Secret {
	for _, s := range r.secrets {
		if s.Name == name {
			return s
		}
	}
	return nil
}

// checkNetworkPolicies: with policies on, every pod is covered, and the only ports that admit
// sources outside the release are the session gRPC port, the credential proxy port and
// /metrics for the configured scrapers.
func checkNetworkPolicies(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	enabled, _ := v.PathValue("networkPolicy.enabled")
	if enabled != true {
		if len(r.netpols) != 0 {
			t.Errorf("networkPolicy disabled but %d rendered", len(r.netpols))
		}
		return
	}
	releaseSel := map[string]string{"app.kubernetes.io/name": "agentplane", "app.kubernetes.io/instance": releaseName}
	for _, w := range r.workloads() {
		covered := false
		for _, np := range r.netpols {
			covered = covered || (selects(&np.Spec.PodSelector, w.pod.Labels) && contains(policyTypes(np), "Ingress"))
		}
		if !covered {
			t.Errorf("%s pods have no ingress NetworkPolicy", w.component)
		}
	}
	for _, np := range r.netpols {
		var comp string
		for _, w := range r.workloads() {
			if selects(&np.Spec.PodSelector, w.pod.Labels) {
				comp = w.component
			}
		}
		for _, rule := range np.Spec.Ingress {
			outside := len(rule.From) == 0
			for _, peer := range rule.From {
				inRelease := peer.PodSelector != nil && peer.NamespaceSelector == nil && peer.IPBlock == nil &&
					labels.SelectorFromSet(peer.PodSelector.MatchLabels).Matches(labels.Set(releaseSel)) &&
					len(peer.PodSelector.MatchLabels) >= len(releaseSel)
				outside = outside || !inRelease
			}
			if len(rule.Ports) == 0 {
				t.Errorf("NetworkPolicy %s has a rule for every port", np.Name)
			}
			for _, p := range rule.Ports {
				port := p.Port.String()
				if !outside {
					continue
				}
				switch {
				case comp == "session" && port == "grpc":
				case comp == "credential" && port == "proxy":
				case port == "metrics" && len(rule.From) > 0:
				default:
					t.Errorf("NetworkPolicy %s admits sources outside the release on %s port %s", np.Name, comp, port)
				}
			}
		}
	}
}

func policyTypes(np *networkingv1.NetworkPolicy) []string {
	var out []string
	for _, p := range np.Spec.PolicyTypes {
		out = append(out, string(p))
	}
	return out
}

func checkNotes(t *testing.T, r *rendered) {
	t.Helper()
	for _, want := range []string{"grpcurl -plaintext", "grpc.health.v1.Health/Check", "port-forward", " list"} {
		if !strings.Contains(r.notes, want) {
			t.Errorf("NOTES.txt lacks %q:\n%s", want, r.notes)
		}
	}
}

func TestMain(m *testing.M) {
	// Tests read the chart by relative path.
	if _, err := os.Stat(filepath.Join(chartDir, "Chart.yaml")); err != nil {
		fmt.Fprintln(os.Stderr, "run from deploy/helm:", err)
		os.Exit(2)
	}
	os.Exit(m.Run())
}
