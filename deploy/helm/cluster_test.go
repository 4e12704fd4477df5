package helm

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	monitoring "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chartutil"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/cli-runtime/pkg/genericclioptions"

	"agentplane.dev/deploy/helm/internal/kubecluster"
)

// The PodSecurity level the chart documents for its namespace (docs/operations.md
// "Installing"): baseline, because of the sandbox pod; every other pod passes restricted
// (TestPodSecurityLevels).
const namespaceLevel = "baseline"

// installTimeout bounds `--wait`; on a quiet machine an install takes seconds (kwok marks the
// pods Running and Ready), the bound is for a loaded one.
const installTimeout = 5 * time.Minute

// TestChartOnCluster installs every ci/*-values.yaml on a real API server with --wait, in a
// namespace that enforces the documented PodSecurity level, upgrades it to a new image tag
// (every workload rolls), and uninstalls it.
func TestChartOnCluster(t *testing.T) {
	c := kubecluster.Start(t, 3)
	ctx := context.Background()
	installMonitoringCRDs(t, c)
	for _, file := range ciFiles(t) {
		name := strings.TrimSuffix(filepath.Base(file), "-values.yaml")
		t.Run(name, func(t *testing.T) {
			vals := readValues(t, file)
			ns := "ap-" + name
			makeNamespace(t, c, ns, namespaceLevel)
			prepare(t, c, ns, vals)
			cfg := helmConfig(t, c.Kubeconfig, ns)

			inst := action.NewInstall(cfg)
			inst.ReleaseName, inst.Namespace = releaseName, ns
			inst.Wait, inst.Timeout = true, installTimeout
			if _, err := inst.Run(loadChart(t), vals); err != nil {
				t.Fatalf("helm install --wait: %v\n%s", err, podProblems(ctx, c, ns))
			}
			checkPodsImage(t, c, ns, "0.1.0")

			up := action.NewUpgrade(cfg)
			up.Namespace = ns
			up.Wait, up.Timeout = true, installTimeout
			upVals := chartutil.Values(vals).AsMap()
			upVals = chartutil.CoalesceTables(map[string]any{"image": map[string]any{"tag": "0.1.1-test"}}, upVals)
			if _, err := up.Run(releaseName, loadChart(t), upVals); err != nil {
				t.Fatalf("helm upgrade --wait: %v\n%s", err, podProblems(ctx, c, ns))
			}
			// --wait returns once the new pods are ready; the old ones may still be terminating.
			waitFor(t, "every pod on the new tag", func() error { return podsImage(ctx, c, ns, "0.1.1-test") })

			un := action.NewUninstall(cfg)
			un.Wait, un.Timeout = true, installTimeout
			if _, err := un.Run(releaseName); err != nil {
				t.Fatalf("helm uninstall --wait: %v", err)
			}
			waitFor(t, "no pod left", func() error {
				pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
				if err == nil && len(pods.Items) > 0 {
					err = fmt.Errorf("%d pods left", len(pods.Items))
				}
				return err
			})
		})
	}
}

// TestChartByNamespaceAdmin: a user who is admin of one namespace only (the ClusterRole
// `admin` bound in it) installs, upgrades and uninstalls the chart there: the chart creates
// nothing cluster-scoped and reads nothing outside its release namespace. In another
// namespace the same user is refused by RBAC.
func TestChartByNamespaceAdmin(t *testing.T) {
	c := kubecluster.Start(t, 1)
	ctx := context.Background()
	const user = "team-admin"
	makeNamespace(t, c, "team", namespaceLevel)
	makeNamespace(t, c, "other", namespaceLevel)
	rb := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "team-admin", Namespace: "team"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: user}},
	}
	if _, err := c.Client.RbacV1().RoleBindings("team").Create(ctx, rb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitAllowed(t, c, user, "team")
	kubeconfig := c.UserKubeconfig(t, user)
	vals := readValues(t, filepath.Join(chartDir, "ci", "minimal-values.yaml"))

	cfg := helmConfig(t, kubeconfig, "team")
	inst := action.NewInstall(cfg)
	inst.ReleaseName, inst.Namespace = releaseName, "team"
	inst.Wait, inst.Timeout = true, installTimeout
	if _, err := inst.Run(loadChart(t), vals); err != nil {
		t.Fatalf("install by the namespace admin: %v\n%s", err, podProblems(ctx, c, "team"))
	}
	up := action.NewUpgrade(cfg)
	up.Namespace = "team"
	up.Wait, up.Timeout = true, installTimeout
	if _, err := up.Run(releaseName, loadChart(t), vals); err != nil {
		t.Fatalf("upgrade by the namespace admin: %v", err)
	}
	if _, err := action.NewUninstall(cfg).Run(releaseName); err != nil {
		t.Fatalf("uninstall by the namespace admin: %v", err)
	}

	other := action.NewInstall(helmConfig(t, kubeconfig, "other"))
	other.ReleaseName, other.Namespace = releaseName, "other"
	_, err := other.Run(loadChart(t), vals)
	if err == nil || !strings.Contains(err.Error(), "forbidden") {
		t.Fatalf("install by the namespace admin into another namespace: %v, want forbidden", err)
	}
}

// waitAllowed waits until the API server's authorizer applies a new binding: the RBAC
// authorizer reads bindings through an informer, so a loaded server may refuse the user for a
// moment after the binding was created (the chart's `lookup` of its Secret was refused so once).
func waitAllowed(t *testing.T, c *kubecluster.Cluster, user, namespace string) {
	t.Helper()
	review := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User:               user,
		ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: namespace, Verb: "get", Resource: "secrets"},
	}}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		got, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), review, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Status.Allowed {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is still not allowed to get secrets in %s: %s", user, namespace, got.Status.Reason)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestPodSecurityLevels asks the API server's PodSecurity admission (server-side dry-run of
// each rendered pod) what the chart documents: every pod but the sandbox's passes
// `restricted`; the sandbox's passes `baseline` with the default values, and `baseline`
// refuses it when the seccomp or AppArmor profile is explicitly set to Unconfined.
func TestPodSecurityLevels(t *testing.T) {
	c := kubecluster.Start(t, 1)
	for _, level := range []string{"restricted", "baseline"} {
		makeNamespace(t, c, level, level)
	}
	for _, file := range ciFiles(t) {
		r, err := render(t, readValues(t, file))
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		for _, w := range r.workloads() {
			sandbox := w.component == "sandbox"
			checkAdmitted(t, c, file, w, "restricted", !sandbox)
			checkAdmitted(t, c, file, w, "baseline", true)
		}
	}
	for _, set := range []map[string]any{
		{"seccompProfile": map[string]any{"type": "Unconfined"}},
		{"appArmorProfile": map[string]any{"type": "Unconfined"}},
	} {
		vals := map[string]any{"redis": map[string]any{"bundled": map[string]any{"enabled": true}},
			"sandbox": map[string]any{"namespaces": set}}
		r, err := render(t, vals)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range r.workloads() {
			if w.component == "sandbox" {
				checkAdmitted(t, c, fmt.Sprintf("sandbox.namespaces=%v", set), w, "baseline", false)
			}
		}
	}
}

func checkAdmitted(t *testing.T, c *kubecluster.Cluster, what string, w workload, ns string, want bool) {
	t.Helper()
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{GenerateName: w.name + "-", Namespace: ns, Labels: w.pod.Labels}, Spec: w.pod.Spec}
	// The ServiceAccount admission wants the chart's ServiceAccount; the namespace's default
	// one stands in (PodSecurity does not look at it).
	pod.Spec.ServiceAccountName = ""
	// A StatefulSet's claim templates become volumes of its pods: the same stand-ins here.
	have := map[string]bool{}
	for _, v := range pod.Spec.Volumes {
		have[v.Name] = true
	}
	for _, m := range pod.Spec.Containers[0].VolumeMounts {
		if !have[m.Name] {
			have[m.Name] = true
			pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: m.Name, VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: m.Name + "-" + w.name + "-0"}}})
		}
	}
	_, err := c.Client.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	switch {
	case want && err != nil:
		t.Errorf("%s: %s pod refused by PodSecurity %q: %v", what, w.component, ns, err)
	case !want && err == nil:
		t.Errorf("%s: %s pod admitted by PodSecurity %q, want refused", what, w.component, ns)
	case !want && !strings.Contains(err.Error(), "violates PodSecurity"):
		t.Errorf("%s: %s pod refused by %q for another reason: %v", what, w.component, ns, err)
	}
}

// helmConfig is what `helm --kubeconfig F -n NS` sets up: release storage in Secrets.
func helmConfig(t *testing.T, kubeconfig, ns string) *action.Configuration {
	t.Helper()
	flags := genericclioptions.NewConfigFlags(false)
	flags.KubeConfig, flags.Namespace = &kubeconfig, &ns
	cfg := new(action.Configuration)
	if err := cfg.Init(flags, ns, "secret", t.Logf); err != nil {
		t.Fatal(err)
	}
	return cfg
}

func makeNamespace(t *testing.T, c *kubecluster.Cluster, name, level string) {
	t.Helper()
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
		"pod-security.kubernetes.io/enforce":         level,
		"pod-security.kubernetes.io/enforce-version": "latest",
	}}}
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitServiceAccount(ctx, name, "default", 3*time.Minute); err != nil {
		t.Fatal(err)
	}
}

// prepare makes what a values file expects the cluster to have: the existing Secret, and
// for a PVC per sandbox replica its StorageClass and pre-made PersistentVolumes (no
// provisioner runs here).
func prepare(t *testing.T, c *kubecluster.Cluster, ns string, vals chartutil.Values) {
	t.Helper()
	ctx := context.Background()
	if name, _ := vals.PathValue("secrets.existingSecret"); name != nil {
		s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name.(string), Namespace: ns}, StringData: map[string]string{
			"internal-token": "test-internal-token", "credential-key": "MDEyMzQ1Njc4OTAxMjM0NTY3ODkwMTIzNDU2Nzg5MDE=",
			"attestation-key": "MDEyMzQ1Njc4OTAxMjM0NTY3ODkwMTIzNDU2Nzg5MDE=", "redis-password": "test-redis-password",
		}}
		if _, err := c.Client.CoreV1().Secrets(ns).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	merged, err := chartutil.CoalesceValues(loadChart(t), vals)
	if err != nil {
		t.Fatal(err)
	}
	if on, _ := merged.PathValue("sandbox.persistence.enabled"); on != true {
		return
	}
	class, _ := merged.PathValue("sandbox.persistence.storageClass")
	size, _ := merged.PathValue("sandbox.persistence.size")
	n, _ := merged.PathValue("sandbox.replicas")
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: class.(string)}, Provisioner: "kubernetes.io/no-provisioner"}
	if class == "" {
		// No class named: the claims take the cluster's default class (DefaultStorageClass
		// admission), which the test cluster gets here.
		class = "ap-default"
		sc.Name = "ap-default"
		sc.Annotations = map[string]string{"storageclass.kubernetes.io/is-default-class": "true"}
	}
	if _, err := c.Client.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for i := range int(toFloat(n)) {
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-pv-%d", ns, i)},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size.(string))},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				StorageClassName:              class.(string),
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
				PersistentVolumeSource:        corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/var/lib/kwok-pv"}},
			},
		}
		if _, err := c.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

func toFloat(v any) float64 {
	switch n := v.(type) {
	case float64:
		return n
	case int:
		return float64(n)
	case int64:
		return float64(n)
	}
	return 0
}

// installMonitoringCRDs makes the ServiceMonitor and PrometheusRule kinds the HA values use,
// named from the prometheus-operator module the render tests decode them with. The schema
// keeps every field: the render tests check the content strictly.
func installMonitoringCRDs(t *testing.T, c *kubecluster.Cluster) {
	t.Helper()
	client, err := apiextensionsclient.NewForConfig(c.Config)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	preserve := true
	for _, k := range []struct{ kind, plural string }{
		{monitoringv1.ServiceMonitorsKind, monitoringv1.ServiceMonitorName},
		{monitoringv1.PrometheusRuleKind, monitoringv1.PrometheusRuleName},
	} {
		crd := &apiextensionsv1.CustomResourceDefinition{
			ObjectMeta: metav1.ObjectMeta{Name: k.plural + "." + monitoring.GroupName},
			Spec: apiextensionsv1.CustomResourceDefinitionSpec{
				Group: monitoring.GroupName,
				Names: apiextensionsv1.CustomResourceDefinitionNames{
					Kind: k.kind, ListKind: k.kind + "List", Plural: k.plural, Singular: strings.ToLower(k.kind),
				},
				Scope: apiextensionsv1.NamespaceScoped,
				Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
					Name: monitoringv1.Version, Served: true, Storage: true,
					Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
						Type: "object", XPreserveUnknownFields: &preserve,
					}},
				}},
			},
		}
		if _, err := client.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "monitoring CRDs served", func() error {
		_, err := c.Client.Discovery().ServerResourcesForGroupVersion(monitoring.GroupName + "/" + monitoringv1.Version)
		return err
	})
}

func checkPodsImage(t *testing.T, c *kubecluster.Cluster, ns, tag string) {
	t.Helper()
	if err := podsImage(context.Background(), c, ns, tag); err != nil {
		t.Fatal(err)
	}
}

// podsImage: every pod of the release runs the image tag, is Running and Ready.
func podsImage(ctx context.Context, c *kubecluster.Cluster, ns, tag string) error {
	pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + releaseName})
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	for _, p := range pods.Items {
		component := p.Labels["app.kubernetes.io/component"]
		seen[component] = true
		if component == "redis" {
			continue
		}
		if img := p.Spec.Containers[0].Image; !strings.HasSuffix(img, ":"+tag) {
			return fmt.Errorf("pod %s runs %s, want tag %s", p.Name, img, tag)
		}
		if p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
			return fmt.Errorf("pod %s is %s (deleting: %v)", p.Name, p.Status.Phase, p.DeletionTimestamp != nil)
		}
	}
	for component := range components {
		if !seen[component] {
			return fmt.Errorf("no %s pod", component)
		}
	}
	return nil
}

// podProblems says why pods are missing: the workloads' and pods' conditions and events.
func podProblems(ctx context.Context, c *kubecluster.Cluster, ns string) string {
	var b strings.Builder
	events, err := c.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	for _, e := range events.Items {
		if e.Type == corev1.EventTypeWarning {
			fmt.Fprintf(&b, "event %s/%s: %s: %s\n", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
		}
	}
	return b.String()
}

func waitFor(t *testing.T, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(installTimeout)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}
