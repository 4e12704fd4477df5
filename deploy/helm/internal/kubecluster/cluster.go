// Package kubecluster starts a real Kubernetes control plane for tests, from the binaries that
// deploy/cluster/build.sh builds into its cache: etcd, kube-apiserver (Node,RBAC authorization,
// the default admission plugins, PodSecurity among them), kube-controller-manager,
// kube-scheduler, and kwok, which plays the kubelet of a few fake nodes (pods get scheduled,
// go Running and Ready; no container runs). Everything listens on private loopback ports and
// lives in the test's temporary directory.
package kubecluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"agentplane.dev/pkg/testaddr"
)

// Cluster is a running control plane with kwok nodes.
type Cluster struct {
	// Dir holds the binaries (bin/) and kwok's stages (stage/).
	Dir string
	// Kubeconfig is the cluster-admin (system:masters) kubeconfig file.
	Kubeconfig string
	// Config and Client are the cluster-admin's.
	Config *rest.Config
	Client kubernetes.Interface
	// Nodes are the names of the kwok nodes, one per zone.
	Nodes []string

	work string
	pki  *pki
	url  string
}

// BinDir returns the cache directory build.sh builds into (AGENTPLANE_CLUSTER_DIR overrides).
func BinDir() (string, error) {
	out, err := exec.Command("bash", buildScript(), "--print-dir").Output()
	if err != nil {
		return "", fmt.Errorf("%s --print-dir: %w", buildScript(), err)
	}
	return strings.TrimSpace(string(out)), nil
}

func buildScript() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "cluster", "build.sh")
}

// Required says whether a missing cluster fails the tests: under CI=true (CI builds it) or
// with AGENTPLANE_TEST_CLUSTER=required.
func Required() bool {
	return os.Getenv("AGENTPLANE_TEST_CLUSTER") == "required" || os.Getenv("CI") == "true"
}

var binaries = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}

// Start starts a cluster with nodes kwok nodes and stops it when the test ends. Without the
// built binaries it skips, or fails when Required (under CI=true a missing component is a
// failure, never a skip).
func Start(t testing.TB, nodes int) *Cluster {
	t.Helper()
	dir, err := BinDir()
	if err == nil {
		for _, b := range binaries {
			if _, e := os.Stat(filepath.Join(dir, "bin", b)); e != nil {
				err = fmt.Errorf("%s missing", b)
				break
			}
		}
	}
	if err != nil {
		msg := fmt.Sprintf("test cluster not built (%v): run `make cluster` (bash deploy/cluster/build.sh)", err)
		if Required() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	work, err := os.MkdirTemp("", "kubecluster-")
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Dir: dir, work: work}
	ctx, cancel := context.WithCancel(context.Background())
	var procs []*exec.Cmd
	t.Cleanup(func() {
		cancel()
		for i := len(procs) - 1; i >= 0; i-- {
			_ = procs[i].Wait()
		}
		if t.Failed() {
			t.Logf("cluster logs kept in %s", work)
			return
		}
		_ = os.RemoveAll(work)
	})
	start := func(name string, args ...string) {
		t.Helper()
		logf, err := os.Create(filepath.Join(work, name+".log"))
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.CommandContext(ctx, filepath.Join(dir, "bin", name), args...)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
		cmd.WaitDelay = 20 * time.Second
		if err := cmd.Start(); err != nil {
			t.Fatalf("start %s: %v", name, err)
		}
		procs = append(procs, cmd)
	}

	if c.pki, err = newPKI(work); err != nil {
		t.Fatal(err)
	}
	etcdPort, peerPort, apiPort, cmPort, schedPort := testaddr.Port(t), testaddr.Port(t), testaddr.Port(t), testaddr.Port(t), testaddr.Port(t)
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(peerPort)
	start("etcd", "--data-dir="+filepath.Join(work, "etcd"), "--name=default",
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=default="+peerURL, "--unsafe-no-fsync=true", "--log-level=warn")

	c.url = "https://127.0.0.1:" + strconv.Itoa(apiPort)
	p := c.pki.path
	start("kube-apiserver", "--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(apiPort),
		"--tls-cert-file="+p("apiserver.crt"), "--tls-private-key-file="+p("apiserver.key"),
		"--client-ca-file="+p("ca.crt"),
		"--authorization-mode=Node,RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+p("sa.pub"), "--service-account-signing-key-file="+p("sa.key"),
		"--service-cluster-ip-range=10.96.0.0/16",
		// Alone on loopback, the apiserver cannot publish itself as the kubernetes Service's endpoint.
		"--endpoint-reconciler-type=none",
		"--allow-privileged=true")

	c.Kubeconfig = filepath.Join(work, "admin.kubeconfig")
	if err := c.writeKubeconfig(c.Kubeconfig, "admin"); err != nil {
		t.Fatal(err)
	}
	if c.Config, err = clientcmd.BuildConfigFromFlags("", c.Kubeconfig); err != nil {
		t.Fatal(err)
	}
	c.Config.QPS, c.Config.Burst = 100, 200
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		t.Fatal(err)
	}
	if err := c.waitReady(ctx, 3*time.Minute); err != nil {
		t.Fatalf("kube-apiserver not ready: %v (logs in %s)", err, work)
	}

	start("kube-controller-manager", "--kubeconfig="+c.Kubeconfig,
		"--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(cmPort), "--leader-elect=false",
		"--service-account-private-key-file="+p("sa.key"), "--root-ca-file="+p("ca.crt"),
		"--use-service-account-credentials=true", "--cluster-cidr=10.244.0.0/16",
		// kwok renews the nodes' leases; on a loaded machine a renewal can lag past the default
		// 50 s grace, the node turns NotReady and `helm upgrade --wait` waits for pods that never
		// become ready (seen with the ha and minimal values beside a CI run). No test here is about
		// node failure.
		"--node-monitor-grace-period=1h")
	start("kube-scheduler", "--kubeconfig="+c.Kubeconfig,
		"--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(schedPort), "--leader-elect=false")
	stages := []string{
		"node/fast/node-initialize.yaml",
		"node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
	}
	podStages, _ := filepath.Glob(filepath.Join(dir, "stage", "pod", "general", "*.yaml"))
	args := []string{"--kubeconfig=" + c.Kubeconfig, "--manage-all-nodes=true", "--cidr=10.244.0.1/16"}
	for _, s := range stages {
		args = append(args, "--config="+filepath.Join(dir, "stage", s))
	}
	for _, s := range podStages {
		if filepath.Base(s) != "kustomization.yaml" {
			args = append(args, "--config="+s)
		}
	}
	start("kwok", args...)

	for i := range nodes {
		name := fmt.Sprintf("kwok-node-%d", i)
		if err := c.createNode(ctx, name, fmt.Sprintf("zone-%d", i)); err != nil {
			t.Fatalf("create node %s: %v", name, err)
		}
		c.Nodes = append(c.Nodes, name)
	}
	if err := c.waitNodesReady(ctx, 3*time.Minute); err != nil {
		t.Fatalf("kwok nodes not Ready: %v (logs in %s)", err, work)
	}
	// Pods need their namespace's default ServiceAccount (the controller-manager makes it).
	if err := c.WaitServiceAccount(ctx, "default", "default", 3*time.Minute); err != nil {
		t.Fatalf("kube-controller-manager: %v (logs in %s)", err, work)
	}
	return c
}

// UserKubeconfig writes a kubeconfig for a user authenticated by a client certificate with
// that common name (no group): what RBAC grants it is up to the test.
func (c *Cluster) UserKubeconfig(t testing.TB, user string) string {
	t.Helper()
	if err := c.pki.client(user, ""); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(c.work, user+".kubeconfig")
	if err := c.writeKubeconfig(path, user); err != nil {
		t.Fatal(err)
	}
	return path
}

func (c *Cluster) writeKubeconfig(path, user string) error {
	ca, err := os.ReadFile(c.pki.path("ca.crt"))
	if err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: %s
  user:
    client-certificate: %s
    client-key: %s
contexts:
- name: test
  context: {cluster: test, user: %s}
current-context: test
`, c.url, b64(ca), user, c.pki.path(user+".crt"), c.pki.path(user+".key"), user)
	return os.WriteFile(path, []byte(cfg), 0o600)
}

func (c *Cluster) waitReady(ctx context.Context, bound time.Duration) error {
	return poll(ctx, bound, func() error {
		body, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			return fmt.Errorf("%w: %s", err, bytes.TrimSpace(body))
		}
		return nil
	})
}

func (c *Cluster) createNode(ctx context.Context, name, zone string) error {
	alloc := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("32"),
		corev1.ResourceMemory: resource.MustParse("256Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
	}
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:        name,
			Annotations: map[string]string{"kwok.x-k8s.io/node": "fake"},
			Labels: map[string]string{
				"kubernetes.io/hostname":      name,
				"kubernetes.io/os":            "linux",
				"kubernetes.io/arch":          "amd64",
				"topology.kubernetes.io/zone": zone,
				"type":                        "kwok",
			},
		},
		Status: corev1.NodeStatus{Capacity: alloc, Allocatable: alloc},
	}
	_, err := c.Client.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	return err
}

func (c *Cluster) waitNodesReady(ctx context.Context, bound time.Duration) error {
	return poll(ctx, bound, func() error {
		for _, name := range c.Nodes {
			n, err := c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			ready := false
			for _, cond := range n.Status.Conditions {
				ready = ready || (cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue)
			}
			if !ready {
				return fmt.Errorf("node %s not Ready", name)
			}
		}
		return nil
	})
}

// WaitServiceAccount waits for a ServiceAccount (e.g. a namespace's default one) to exist.
func (c *Cluster) WaitServiceAccount(ctx context.Context, ns, name string, bound time.Duration) error {
	return poll(ctx, bound, func() error {
		_, err := c.Client.CoreV1().ServiceAccounts(ns).Get(ctx, name, metav1.GetOptions{})
		return err
	})
}

// poll calls f every 200ms until it returns nil or the bound passes (the bound is generous: the
// machine may be loaded; the call returns as soon as the condition holds).
func poll(ctx context.Context, bound time.Duration, f func() error) error {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	var last error
	for {
		if last = f(); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
