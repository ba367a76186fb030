//go:build integration || compose

package integration

import dto "github.com/prometheus/client_model/go"

// sum adds every sample of family name whose labels include want.
func sum(mf map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	f, ok := mf[name]
	if !ok {
		return 0
	}
	var total float64
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if have[k] != v {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			total += m.GetCounter().GetValue()
		case m.Gauge != nil:
			total += m.GetGauge().GetValue()
		case m.Histogram != nil:
			total += float64(m.GetHistogram().GetSampleCount())
		case m.Untyped != nil:
			total += m.GetUntyped().GetValue()
		}
	}
	return total
}
