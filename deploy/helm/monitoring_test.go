package helm

import (
	"context"
	"encoding/json"
	"maps"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/promslog"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/promql/promqltest"
	"github.com/prometheus/prometheus/rules"
	"helm.sh/helm/v3/pkg/chartutil"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
)

// wantAlerts are the alerts docs/operations.md describes; the chart must ship exactly these.
var wantAlerts = []string{
	"AgentplaneCapacityRejections", "AgentplaneCleanupSlow", "AgentplaneExhaustedLeases",
	"AgentplaneLeakedWrappers", "AgentplaneProxy5xxRatio", "AgentplaneServiceDown", "AgentplaneServiceNotReady",
}

func enabled(v chartutil.Values, key string) bool {
	on, _ := v.PathValue(key + ".enabled")
	b, _ := on.(bool)
	return b
}

func checkPrometheusRule(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	if !enabled(v, "prometheusRule") {
		if len(r.prometheusRules) != 0 {
			t.Errorf("prometheusRule.enabled=false rendered %d PrometheusRules", len(r.prometheusRules))
		}
		return
	}
	if len(r.prometheusRules) != 1 {
		t.Fatalf("prometheusRule.enabled: %d PrometheusRules, want 1", len(r.prometheusRules))
	}
	pr := r.prometheusRules[0]
	if pr.Namespace != namespace {
		t.Errorf("PrometheusRule in namespace %q, want %q", pr.Namespace, namespace)
	}
	var names []string
	for _, rule := range alertRules(pr) {
		names = append(names, rule.Alert)
		expr, err := parser.ParseExpr(rule.Expr.String())
		if err != nil {
			t.Errorf("alert %s: expression does not parse: %v\n%s", rule.Alert, err, rule.Expr.String())
			continue
		}
		if _, err := time.ParseDuration(string(*rule.For)); err != nil {
			t.Errorf("alert %s: for %q: %v", rule.Alert, *rule.For, err)
		}
		if rule.Labels["severity"] == "" || rule.Annotations["summary"] == "" || !strings.HasPrefix(rule.Annotations["runbook"], "docs/operations.md#") {
			t.Errorf("alert %s: needs a severity label, a summary and a docs/operations.md runbook", rule.Alert)
		}
		// Every selector is limited to this release's series.
		parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
			if vs, ok := n.(*parser.VectorSelector); ok {
				var ns bool
				for _, m := range vs.LabelMatchers {
					ns = ns || (m.Name == "namespace" && m.Value == namespace)
				}
				if !ns {
					t.Errorf("alert %s: selector %s is not limited to namespace %s", rule.Alert, vs, namespace)
				}
			}
			return nil
		})
	}
	slices.Sort(names)
	if !slices.Equal(names, wantAlerts) {
		t.Errorf("alerts %v, want %v", names, wantAlerts)
	}
}

func alertRules(pr *monitoringv1.PrometheusRule) []monitoringv1.Rule {
	var out []monitoringv1.Rule
	for _, g := range pr.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				out = append(out, r)
			}
		}
	}
	return out
}

// metricNames are the metric names a PromQL expression reads.
func metricNames(t *testing.T, expr string) []string {
	t.Helper()
	e, err := parser.ParseExpr(expr)
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	var out []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			out = append(out, vs.Name)
		}
		return nil
	})
	return out
}

func checkDashboard(t *testing.T, r *rendered, v chartutil.Values) {
	t.Helper()
	cm := findConfigMap(r, releaseName+"-agentplane-dashboard")
	if !enabled(v, "grafanaDashboard") {
		if cm != nil {
			t.Error("grafanaDashboard.enabled=false rendered the dashboard ConfigMap")
		}
		return
	}
	if cm == nil {
		t.Fatal("grafanaDashboard.enabled: no dashboard ConfigMap")
	}
	label, _ := v.PathValue("grafanaDashboard.sidecarLabel")
	value, _ := v.PathValue("grafanaDashboard.sidecarLabelValue")
	if cm.Labels[label.(string)] != value.(string) {
		t.Errorf("dashboard ConfigMap labels %v lack the sidecar label %s=%s", cm.Labels, label, value)
	}
	var dash struct {
		Title  string `json:"title"`
		UID    string `json:"uid"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	dec := json.NewDecoder(strings.NewReader(cm.Data["agentplane.json"]))
	if err := dec.Decode(&dash); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	if dash.Title == "" || dash.UID == "" || len(dash.Panels) == 0 {
		t.Fatalf("dashboard has no title, uid or panels")
	}
	vars := strings.NewReplacer("$namespace", namespace)
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			metricNames(t, vars.Replace(tg.Expr)) // fails on an expression that does not parse
		}
	}
}

// TestAlertRulesFireAndStaySilent evaluates each alert of the rendered PrometheusRule with
// Prometheus's own rule engine (what `promtool test rules` runs) on synthetic series: each
// fires on a series that should fire it, after its `for`, and stays silent on one that
// should not.
func TestAlertRulesFireAndStaySilent(t *testing.T) {
	vals := readValues(t, "agentplane/ci/ha-values.yaml")
	r, err := render(t, vals)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.prometheusRules) != 1 {
		t.Fatalf("%d PrometheusRules rendered", len(r.prometheusRules))
	}
	byName := map[string]monitoringv1.Rule{}
	for _, rule := range alertRules(r.prometheusRules[0]) {
		byName[rule.Alert] = rule
	}
	sel := func(job string) string {
		return `{namespace="` + namespace + `", job="` + releaseName + "-agentplane-" + job + `"`
	}
	cases := []struct {
		alert        string
		fire, silent string // promqltest load blocks, 1m steps over 40 minutes
	}{
		{"AgentplaneLeakedWrappers",
			"agentplane_sandbox_leaked_wrappers" + sel("sandbox") + "} 0x5 1x35",
			"agentplane_sandbox_leaked_wrappers" + sel("sandbox") + "} 0x5 1x5 0x30"}, // stopped within 10 min
		{"AgentplaneExhaustedLeases",
			"agentplane_sandbox_exhausted_leases" + sel("sandbox") + "} 0x20 1x20",
			"agentplane_sandbox_exhausted_leases" + sel("sandbox") + "} 0x40"},
		{"AgentplaneCleanupSlow",
			// every cleanup in the 120 s bucket (over the 60 s bound) vs every one within 10 s.
			"agentplane_sandbox_cleanup_duration_seconds_bucket" + sel("sandbox") + `, le="10"} 0x40` + "\n" +
				"agentplane_sandbox_cleanup_duration_seconds_bucket" + sel("sandbox") + `, le="120"} 0+5x40` + "\n" +
				"agentplane_sandbox_cleanup_duration_seconds_bucket" + sel("sandbox") + `, le="+Inf"} 0+5x40`,
			"agentplane_sandbox_cleanup_duration_seconds_bucket" + sel("sandbox") + `, le="10"} 0+5x40` + "\n" +
				"agentplane_sandbox_cleanup_duration_seconds_bucket" + sel("sandbox") + `, le="120"} 0+5x40` + "\n" +
				"agentplane_sandbox_cleanup_duration_seconds_bucket" + sel("sandbox") + `, le="+Inf"} 0+5x40`},
		{"AgentplaneCapacityRejections",
			"agentplane_sandbox_capacity_admissions_total" + sel("sandbox") + `, result="rejected"} 0+2x40`,
			"agentplane_sandbox_capacity_admissions_total" + sel("sandbox") + `, result="rejected"} 0+0.1x40`},
		{"AgentplaneProxy5xxRatio",
			"agentplane_credential_proxy_requests_total" + sel("credential") + `, route="provider", code="200"} 0+100x40` + "\n" +
				"agentplane_credential_proxy_requests_total" + sel("credential") + `, route="provider", code="502"} 0+20x40`,
			"agentplane_credential_proxy_requests_total" + sel("credential") + `, route="provider", code="200"} 0+100x40` + "\n" +
				"agentplane_credential_proxy_requests_total" + sel("credential") + `, route="provider", code="502"} 0+1x40`},
		{"AgentplaneServiceDown",
			"up" + sel("session") + `, pod="s-0"} 1x10 0x30`,
			"up" + sel("session") + `, pod="s-0"} 1x10 0x3 1x27`}, // a blip shorter than 5 min
		{"AgentplaneServiceNotReady",
			"agentplane_ready" + sel("ingest") + `, pod="i-0"} 1x10 0x30`,
			"agentplane_ready" + sel("ingest") + `, pod="i-0"} 1x40`},
	}
	tested := map[string]bool{}
	for _, c := range cases {
		tested[c.alert] = true
		rule, ok := byName[c.alert]
		if !ok {
			t.Errorf("alert %s not rendered", c.alert)
			continue
		}
		t.Run(c.alert, func(t *testing.T) {
			if got := firing(t, rule, c.fire); !got {
				t.Errorf("did not fire on\n%s\nexpr: %s", c.fire, rule.Expr.String())
			}
			if got := firing(t, rule, c.silent); got {
				t.Errorf("fired on\n%s\nexpr: %s", c.silent, rule.Expr.String())
			}
		})
	}
	for _, name := range slices.Sorted(maps.Keys(byName)) {
		if !tested[name] {
			t.Errorf("alert %s has no fire/silent case", name)
		}
	}
}

var loadLine = regexp.MustCompile(`\n+`)

// firing loads series (1m steps) and evaluates rule every minute for 40 minutes, as the
// rule manager would; it reports whether the alert is firing at the end.
func firing(t *testing.T, rule monitoringv1.Rule, series string) bool {
	t.Helper()
	storage := promqltest.LoadedStorage(t, "load 1m\n  "+loadLine.ReplaceAllString(series, "\n  "))
	t.Cleanup(func() { _ = storage.Close() })
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1e6, Timeout: time.Minute, LookbackDelta: 5 * time.Minute})
	expr, err := parser.ParseExpr(rule.Expr.String())
	if err != nil {
		t.Fatal(err)
	}
	hold, err := time.ParseDuration(string(*rule.For))
	if err != nil {
		t.Fatal(err)
	}
	ar := rules.NewAlertingRule(rule.Alert, expr, hold, 0, labels.FromMap(rule.Labels), labels.FromMap(rule.Annotations),
		labels.EmptyLabels(), "", true, promslog.NewNopLogger())
	query := rules.EngineQueryFunc(engine, storage)
	start := time.Unix(0, 0)
	var last bool
	for m := 0; m <= 40; m++ {
		ts := start.Add(time.Duration(m) * time.Minute)
		if _, err := ar.Eval(context.Background(), 0, ts, query, nil, 0); err != nil {
			t.Fatalf("eval at %dm: %v", m, err)
		}
		last = false
		for _, a := range ar.ActiveAlerts() {
			last = last || a.State == rules.StateFiring
		}
	}
	return last
}
