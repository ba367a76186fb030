package worker

import "github.com/prometheus/client_golang/prometheus"

// prometheusNopRegisterer accepts collectors without exposing them.
type prometheusNopRegisterer struct{}

func (prometheusNopRegisterer) Register(prometheus.Collector) error  { return nil }
func (prometheusNopRegisterer) MustRegister(...prometheus.Collector) {}
func (prometheusNopRegisterer) Unregister(prometheus.Collector) bool { return true }
