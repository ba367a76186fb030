package service

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
)

// dashboardPath is the Grafana dashboard shipped for operators.
const dashboardPath = "../../deploy/grafana/handoff.json"

// Every PromQL expression of the dashboard (panel targets and template
// variable queries) names only metrics that a real prefill or decode
// worker exposes (issue 15): a renamed metric or a typo in a panel fails
// here, not on an operator's screen.
func TestDashboardNamesExistingMetrics(t *testing.T) {
	raw, err := os.ReadFile(dashboardPath)
	require.NoError(t, err)

	ns := natstest.Run(t)
	pep, _ := startWorker(t, testConfig(t, worker.RolePrefill, "--nats-url", ns.ClientURL(), "--namespace", "dashboard"))
	// Decode speculates, so that its speculative-decoding series exist.
	dep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--nats-url", ns.ClientURL(), "--namespace", "dashboard", "--speculative", "ngram"))
	// One completion, so that the series set on the first transfer (the
	// transport in use) exist too.
	require.Eventually(t, func() bool {
		return complete(t, dep.HTTP, "dashboard", 2, 0, 1).status == http.StatusOK
	}, 15*time.Second, 100*time.Millisecond)
	have := map[string]bool{}
	for _, ep := range []Endpoints{pep, dep} {
		for name := range exposedSeriesNames(t, ep.Admin) {
			have[name] = true
		}
	}

	missing, named, err := dashboardMissingMetrics(raw, have)
	require.NoError(t, err)
	require.Empty(t, missing, "the dashboard names metrics no worker exposes")
	// The extractor really found the dashboard's metrics (a tokenizer that
	// finds nothing would pass the check above).
	for _, want := range []string{
		"handoff_requests_total", "handoff_time_to_first_token_seconds_bucket", "handoff_queue_duration_seconds_bucket",
		"handoff_prefill_duration_seconds_bucket", "handoff_transfer_duration_seconds_bucket",
		"handoff_transfer_bytes_total", "handoff_mamba_rows", "handoff_kv_blocks", "handoff_dummy_requests_total",
		"handoff_retries_total", "handoff_quarantined_bytes", "handoff_sessions_inflight", "handoff_queued_requests",
		"handoff_prefix_hit_tokens_total", "handoff_prompt_tokens_computed_total", "handoff_prefix_cached_blocks",
		"handoff_state_checkpoint_rows", "handoff_prefix_evictions_total",
		"handoff_prefill_routed_total", "handoff_cache_event_batches_total", "handoff_cache_event_syncs_total",
		"handoff_spec_accepted_tokens_total", "handoff_spec_draft_tokens_total", "handoff_spec_verifications_total", "handoff_spec_gated",
	} {
		require.Contains(t, named, want, "the dashboard has no panel on %s", want)
	}
}

// A panel or variable naming a metric that does not exist is reported with
// where it is.
func TestDashboardMissingMetricReported(t *testing.T) {
	dash := `{"panels":[
	  {"title":"ok","targets":[{"expr":"sum(rate(handoff_requests_total[5m]))"}]},
	  {"type":"row","title":"r","panels":[
	    {"title":"typo","targets":[{"expr":"histogram_quantile(0.9, sum by (le) (rate(handoff_ttft_seconds_bucket[5m])))"}]}]}],
	 "templating":{"list":[{"name":"job","query":{"query":"label_values(handoff_nope_total, job)"}}]}}`
	have := map[string]bool{"handoff_requests_total": true}
	missing, _, err := dashboardMissingMetrics([]byte(dash), have)
	require.NoError(t, err)
	require.Len(t, missing, 2)
	require.Contains(t, missing[0], "handoff_ttft_seconds_bucket")
	require.Contains(t, missing[0], `"typo"`)
	require.Contains(t, missing[1], "handoff_nope_total")
}

func TestPromQLMetricNames(t *testing.T) {
	tests := []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		{`sum by (role, result) (rate(handoff_requests_total{job=~"$job",result!="ok"}[$__rate_interval]))`,
			[]string{"handoff_requests_total"}},
		{`histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{role="decode"}[5m])))`, []string{"a_seconds_bucket"}},
		{`sum(rate(a_total[1m])) by (le, instance) / ignoring(kind) group_left(rank) b`, []string{"a_total", "b"}},
		{`sum without (kind) (a) / count by (rank) (b) + topk by (x) (2, c)`, []string{"a", "b", "c"}},
		{`a and on(instance) b or c unless d`, []string{"a", "b", "c", "d"}},
		{`a > bool 0.5`, []string{"a"}},
		{`a offset 5m + b @ 1609746000`, []string{"a", "b"}},
		{`{__name__="x_total", job="y"}`, []string{"x_total"}},
		{`label_values(handoff_requests_total{job=~"$job"}, instance)`, []string{"handoff_requests_total"}},
		{`label_values(job)`, nil},
		{`count(a{l="rate(b_total[5m])"}) without (mode)`, []string{"a"}},
		{`max_over_time(a[10m:1m]) * on() group_right() vector(1)`, []string{"a"}},
		{`${__interval} + $var * a:recorded:rate5m`, []string{"a:recorded:rate5m"}},
		{`topk(3, a) + 1e3 + 0x1f + Inf - NaN`, []string{"a"}},
		{`'single' + "double \" quote" + ` + "`raw`" + ` + a`, []string{"a"}},
	}
	for _, tt := range tests {
		t.Run(tt.expr, func(t *testing.T) {
			require.Equal(t, tt.want, promqlMetricNames(tt.expr))
		})
	}
}

// exposedSeriesNames scrapes a worker's /metrics and returns every name a
// query can select: each family's, and a histogram's or summary's _bucket,
// _sum and _count.
func exposedSeriesNames(t *testing.T, admin string) map[string]bool {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	names := map[string]bool{}
	for name, mf := range mfs {
		names[name] = true
		switch mf.GetType() {
		case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
			names[name+"_bucket"], names[name+"_sum"], names[name+"_count"] = true, true, true
		case dto.MetricType_SUMMARY:
			names[name+"_sum"], names[name+"_count"] = true, true
		}
	}
	return names
}

// dashboardMissingMetrics walks a Grafana dashboard (panels, rows' panels,
// template variables) and returns one line per metric an expression names
// that have lacks, and every metric named.
func dashboardMissingMetrics(raw []byte, have map[string]bool) (missing, named []string, err error) {
	var dash struct {
		Panels     []grafanaPanel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		return nil, nil, err
	}
	check := func(where, expr string) {
		for _, name := range promqlMetricNames(expr) {
			if !slices.Contains(named, name) {
				named = append(named, name)
			}
			if !have[name] {
				missing = append(missing, fmt.Sprintf("%s: %s in %s", where, name, expr))
			}
		}
	}
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				check(fmt.Sprintf("panel %q target %s", p.Title, tg.RefID), tg.Expr)
			}
			walk(p.Panels)
		}
	}
	walk(dash.Panels)
	for _, v := range dash.Templating.List {
		// A query variable's query is a string or {"query": "..."}.
		var q string
		if json.Unmarshal(v.Query, &q) != nil {
			var obj struct {
				Query string `json:"query"`
			}
			_ = json.Unmarshal(v.Query, &obj)
			q = obj.Query
		}
		if !strings.Contains(q, "(") && !strings.Contains(q, "{") {
			continue // a datasource type ("prometheus") or a constant, not PromQL
		}
		check(fmt.Sprintf("variable %q", v.Name), q)
	}
	return missing, named, nil
}

type grafanaPanel struct {
	Title   string `json:"title"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's
}

// promqlKeywords are the words of PromQL that are never metric names:
// operators, modifiers and the aggregation operators, which may be followed
// by by/without before their '(' (functions are told apart by the '(').
var promqlKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "bool": true, "offset": true, "inf": true, "nan": true,
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"atan2": true, "sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true,
	"stdvar": true, "count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
	"limitk": true, "limit_ratio": true,
}

// promqlMetricNames returns the metric names an expression selects, in
// order of first appearance: a small tokenizer rather than the Prometheus
// parser (a large dependency). It skips strings, label matchers (but for a
// __name__ matcher), range and subquery brackets, numbers and durations,
// Grafana variables ($x, ${x}), the label lists of by, without, on,
// ignoring, group_left and group_right, keywords, and identifiers followed
// by '(' (functions, aggregations), and the label of Grafana's
// label_values.
func promqlMetricNames(expr string) []string {
	var names []string
	add := func(n string) {
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	skipString := func(i int) int { // i at the quote; returns the index after the closing one
		q := expr[i]
		for i++; i < len(expr) && expr[i] != q; i++ {
			if expr[i] == '\\' && q != '`' {
				i++
			}
		}
		return i + 1
	}
	nextNonSpace := func(i int) int {
		for i < len(expr) && strings.ContainsRune(" \t\r\n", rune(expr[i])) {
			i++
		}
		return i
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			i = skipString(i)
		case c == '{': // label matchers; only __name__ names a metric
			j := i + 1
			for j < len(expr) && expr[j] != '}' {
				if expr[j] == '"' || expr[j] == '\'' || expr[j] == '`' {
					j = skipString(j)
					continue
				}
				if strings.HasPrefix(expr[j:], "__name__") {
					k := nextNonSpace(j + len("__name__"))
					if k < len(expr) && expr[k] == '=' {
						k = nextNonSpace(k + 1)
						if k < len(expr) && (expr[k] == '"' || expr[k] == '\'' || expr[k] == '`') {
							end := skipString(k)
							add(expr[k+1 : end-1])
							j = end
							continue
						}
					}
				}
				j++
			}
			i = j + 1
		case c == '[': // a range or subquery: durations only
			for i < len(expr) && expr[i] != ']' {
				i++
			}
			i++
		case c == '$': // a Grafana variable
			i++
			if i < len(expr) && expr[i] == '{' {
				for i < len(expr) && expr[i] != '}' {
					i++
				}
				i++
				continue
			}
			for i < len(expr) && isIdent(expr[i]) {
				i++
			}
		case c >= '0' && c <= '9' || c == '.': // a number or a duration (1e3, 0x1f, 5m)
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word := expr[i:j]
			k := nextNonSpace(j)
			followedByParen := k < len(expr) && expr[k] == '('
			lower := strings.ToLower(word)
			switch {
			case lower == "by" || lower == "without" || lower == "on" || lower == "ignoring" ||
				lower == "group_left" || lower == "group_right":
				if followedByParen { // a label list
					for k < len(expr) && expr[k] != ')' {
						k++
					}
					j = k + 1
				}
			case promqlKeywords[lower]:
			case word == "label_values" && followedByParen:
				// Grafana's label_values([series,] label): the label is
				// no metric; the series is a selector.
				end, comma := k+1, -1
				for depth := 1; end < len(expr) && depth > 0; end++ {
					switch expr[end] {
					case '"', '\'', '`':
						end = skipString(end) - 1
					case '(', '{':
						depth++
					case ')', '}':
						depth--
					case ',':
						if depth == 1 {
							comma = end
						}
					}
				}
				if comma > 0 {
					for _, n := range promqlMetricNames(expr[k+1 : comma]) {
						add(n)
					}
				}
				j = end
			case followedByParen: // a function or an aggregation
			default:
				add(word)
			}
			i = j
		default:
			i++
		}
	}
	return names
}
