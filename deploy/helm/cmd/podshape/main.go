// Command podshape renders the chart with the Helm SDK (as `helm template` with the given values
// files and --set values) and prints, as JSON, how each service's pod runs its container: its
// uid and gids, security settings, environment (the ConfigMap first, then the container's own
// env, as the kubelet composes them) and volume mounts. The e2e suite
// (cmd/agentplane/e2e/chartshape_test.go) starts the services in that shape.
//
//	go run ./cmd/podshape -f agentplane/ci/default-values.yaml --set redis.url=redis://127.0.0.1:6379/0
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/releaseutil"
	"helm.sh/helm/v3/pkg/strvals"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// Shape is every service's pod, by component (session, sandbox, credential, ingest).
type Shape struct {
	Services map[string]*Service `json:"services"`
}

// Service is one container as its pod spec runs it.
type Service struct {
	Args                     []string `json:"args"`
	UID                      int64    `json:"uid"`
	GID                      int64    `json:"gid"`
	FSGroup                  int64    `json:"fsGroup"`
	RunAsNonRoot             bool     `json:"runAsNonRoot"`
	ReadOnlyRootFilesystem   bool     `json:"readOnlyRootFilesystem"`
	AllowPrivilegeEscalation bool     `json:"allowPrivilegeEscalation"`
	Privileged               bool     `json:"privileged"`
	CapabilitiesDrop         []string `json:"capabilitiesDrop"`
	CapabilitiesAdd          []string `json:"capabilitiesAdd"`
	HostUsers                *bool    `json:"hostUsers"`
	ProcMount                string   `json:"procMount"`
	Seccomp                  string   `json:"seccomp"`
	AppArmor                 string   `json:"appArmor"`
	Env                      []EnvVar `json:"env"`
	Mounts                   []Mount  `json:"mounts"`
}

// EnvVar is a value, or a field of the pod (FieldPath, e.g. status.podIP).
type EnvVar struct {
	Name      string `json:"name"`
	Value     string `json:"value"`
	FieldPath string `json:"fieldPath,omitempty"`
}

// Mount is a volume mount: an emptyDir or PersistentVolumeClaim (writable unless read-only) or
// Secret keys as files (Files: key -> file name, Mode the files' mode).
type Mount struct {
	Path     string            `json:"path"`
	ReadOnly bool              `json:"readOnly"`
	Kind     string            `json:"kind"`
	Files    map[string]string `json:"files,omitempty"`
	Mode     int32             `json:"mode,omitempty"`
}

type setFlags []string

func (s *setFlags) String() string     { return strings.Join(*s, ",") }
func (s *setFlags) Set(v string) error { *s = append(*s, v); return nil }

func main() {
	var files, sets setFlags
	chartDir := flag.String("chart", "agentplane", "chart directory")
	flag.Var(&files, "f", "values file (repeatable)")
	flag.Var(&sets, "set", "key=value (repeatable)")
	flag.Parse()
	if err := run(*chartDir, files, sets); err != nil {
		fmt.Fprintln(os.Stderr, "podshape:", err)
		os.Exit(1)
	}
}

func run(chartDir string, files, sets []string) error {
	vals := map[string]any{}
	for _, f := range files {
		v, err := chartutil.ReadValuesFile(f)
		if err != nil {
			return err
		}
		vals = chartutil.CoalesceTables(v.AsMap(), vals)
	}
	for _, s := range sets {
		if err := strvals.ParseInto(s, vals); err != nil {
			return err
		}
	}
	ch, err := loader.Load(chartDir)
	if err != nil {
		return err
	}
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun, inst.ClientOnly, inst.Replace = true, true, true
	inst.ReleaseName, inst.Namespace = "ap", "agentplane"
	if inst.KubeVersion, err = chartutil.ParseKubeVersion("v1.37.0"); err != nil {
		return err
	}
	rel, err := inst.Run(ch, vals)
	if err != nil {
		return err
	}
	config := map[string]map[string]string{}
	var pods []corev1.PodTemplateSpec
	for _, doc := range releaseutil.SplitManifests(rel.Manifest) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			return err
		}
		switch tm.Kind {
		case "ConfigMap":
			var cm corev1.ConfigMap
			if err := yaml.Unmarshal([]byte(doc), &cm); err != nil {
				return err
			}
			config[cm.Name] = cm.Data
		case "Deployment":
			var d appsv1.Deployment
			if err := yaml.Unmarshal([]byte(doc), &d); err != nil {
				return err
			}
			pods = append(pods, d.Spec.Template)
		case "StatefulSet":
			var s appsv1.StatefulSet
			if err := yaml.Unmarshal([]byte(doc), &s); err != nil {
				return err
			}
			pods = append(pods, s.Spec.Template)
		}
	}
	out := Shape{Services: map[string]*Service{}}
	for _, p := range pods {
		component := p.Labels["app.kubernetes.io/component"]
		if component == "redis" {
			continue
		}
		s, err := shape(p.Spec, config)
		if err != nil {
			return fmt.Errorf("%s: %w", component, err)
		}
		out.Services[component] = s
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func shape(spec corev1.PodSpec, config map[string]map[string]string) (*Service, error) {
	if len(spec.Containers) != 1 {
		return nil, fmt.Errorf("%d containers, want 1", len(spec.Containers))
	}
	c := spec.Containers[0]
	psc, sc := spec.SecurityContext, c.SecurityContext
	if psc == nil || sc == nil {
		return nil, fmt.Errorf("no securityContext")
	}
	s := &Service{Args: c.Args, HostUsers: spec.HostUsers}
	s.UID, s.GID, s.FSGroup = deref(psc.RunAsUser), deref(psc.RunAsGroup), deref(psc.FSGroup)
	if sc.RunAsUser != nil {
		s.UID = *sc.RunAsUser
	}
	if sc.RunAsGroup != nil {
		s.GID = *sc.RunAsGroup
	}
	s.RunAsNonRoot = derefBool(psc.RunAsNonRoot) || derefBool(sc.RunAsNonRoot)
	s.ReadOnlyRootFilesystem = derefBool(sc.ReadOnlyRootFilesystem)
	s.AllowPrivilegeEscalation = sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation
	s.Privileged = derefBool(sc.Privileged)
	if sc.Capabilities != nil {
		for _, cap := range sc.Capabilities.Drop {
			s.CapabilitiesDrop = append(s.CapabilitiesDrop, string(cap))
		}
		for _, cap := range sc.Capabilities.Add {
			s.CapabilitiesAdd = append(s.CapabilitiesAdd, string(cap))
		}
	}
	if sc.ProcMount != nil {
		s.ProcMount = string(*sc.ProcMount)
	}
	s.Seccomp = profile(psc.SeccompProfile, sc.SeccompProfile)
	if sc.AppArmorProfile != nil {
		s.AppArmor = string(sc.AppArmorProfile.Type)
	} else if psc.AppArmorProfile != nil {
		s.AppArmor = string(psc.AppArmorProfile.Type)
	}
	for _, from := range c.EnvFrom {
		if from.ConfigMapRef == nil || config[from.ConfigMapRef.Name] == nil {
			return nil, fmt.Errorf("envFrom other than the chart's ConfigMap")
		}
		for _, k := range slices.Sorted(maps.Keys(config[from.ConfigMapRef.Name])) {
			s.Env = append(s.Env, EnvVar{Name: k, Value: config[from.ConfigMapRef.Name][k]})
		}
	}
	for _, e := range c.Env {
		v := EnvVar{Name: e.Name, Value: e.Value}
		if e.ValueFrom != nil {
			if e.ValueFrom.FieldRef == nil {
				return nil, fmt.Errorf("env %s: only fieldRef is known here", e.Name)
			}
			v.FieldPath = e.ValueFrom.FieldRef.FieldPath
		}
		s.Env = append(s.Env, v)
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	for _, m := range c.VolumeMounts {
		mount := Mount{Path: m.MountPath, ReadOnly: m.ReadOnly}
		v, ok := volumes[m.Name]
		switch {
		case !ok:
			mount.Kind = "pvc" // a volumeClaimTemplate of the StatefulSet
		case v.EmptyDir != nil:
			mount.Kind = "emptyDir"
		case v.Secret != nil:
			mount.Kind, mount.ReadOnly, mount.Files = "secret", true, map[string]string{}
			mount.Mode = deref32(v.Secret.DefaultMode)
			for _, it := range v.Secret.Items {
				mount.Files[it.Key] = it.Path
			}
		case v.PersistentVolumeClaim != nil:
			mount.Kind = "pvc"
		default:
			return nil, fmt.Errorf("volume %s: a kind this tool does not know", m.Name)
		}
		s.Mounts = append(s.Mounts, mount)
	}
	return s, nil
}

func profile(pod, container *corev1.SeccompProfile) string {
	p := pod
	if container != nil {
		p = container
	}
	if p == nil {
		return ""
	}
	if p.LocalhostProfile != nil {
		return string(p.Type) + "/" + *p.LocalhostProfile
	}
	return string(p.Type)
}

func deref(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}

func deref32(p *int32) int32 {
	if p == nil {
		return 0
	}
	return *p
}

func derefBool(p *bool) bool { return p != nil && *p }
