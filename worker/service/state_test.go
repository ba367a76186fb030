package service

import (
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/transfer/wire"
	"github.com/handoff-io/handoff/worker"
)

// TestStateOfferRefusals: a malformed offer and one of another layout are
// refused by name before anything is admitted or a byte moves (the
// adopter has no scheduler to reach here).
func TestStateOfferRefusals(t *testing.T) {
	m := worker.NewMetrics(prometheus.NewRegistry())
	a := &stateAdopter{fp: "fp-this", m: m, log: slog.New(slog.DiscardHandler)}
	a.onOffer(&nats.Msg{Data: []byte{0xc1, 0x00}})
	other, err := wire.EncodeStateOffer(wire.StateOffer{From: "d1", Fingerprint: "fp-other", Tokens: wire.Tokens{1, 2}}, 0)
	require.NoError(t, err)
	a.onOffer(&nats.Msg{Data: other})
	require.Equal(t, 1.0, testutil.ToFloat64(m.StateReturns.WithLabelValues("prefill", "malformed")))
	require.Equal(t, 1.0, testutil.ToFloat64(m.StateReturns.WithLabelValues("prefill", "layout_mismatch")))
}
