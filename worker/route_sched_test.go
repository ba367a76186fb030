package worker

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// countingSource is a loopback CacheSource that counts its fetches, or
// refuses every one when refuse is set, or fails every one mid-way when
// fail is set: it scribbles over the destination's KV runs and Mamba row
// (the bytes a dying writer may leave) and returns ErrTransferFailed.
type countingSource struct {
	gateSource
	fetches atomic.Int32
	refuse  bool
	fail    bool
}

func (c *countingSource) Fetch(ctx context.Context, f FetchRequest) (FetchResult, error) {
	c.fetches.Add(1)
	switch {
	case c.refuse:
		return FetchResult{}, fmt.Errorf("%w: no prefill worker", ErrTransferRefused)
	case c.fail:
		d := c.dst[f.Rank]
		for _, run := range f.Runs {
			x := d.kvCfg.RunExtent(run)
			fill(d.kvArena[x.Offset:x.Offset+x.Length], 0x7f)
		}
		x := d.mCfg.RowExtent(f.Row)
		fill(d.mambaArena[x.Offset:x.Offset+x.Length], 0x7f)
		return FetchResult{}, fmt.Errorf("%w: prefill worker died mid-write", ErrTransferFailed)
	}
	return c.gateSource.Fetch(ctx, f)
}

func fill(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}

func routes(t *testing.T, m *Metrics, route, reason string) float64 {
	t.Helper()
	return counterValue(t, m.PrefillRoutes.WithLabelValues(string(RoleDecode), route, reason))
}

// generateChecked runs one greedy request to its end, checks its tokens
// against the reference and returns its timing.
func generateChecked(t *testing.T, s *Scheduler, prompt string) Timing {
	t.Helper()
	st, err := s.Generate(context.Background(), GenerateRequest{Prompt: model.Encode(prompt), MaxTokens: 6})
	require.NoError(t, err)
	toks, ev := drainStream(t, st)
	require.NoError(t, ev.Err)
	require.Equal(t, reference(t, model.TinyHybrid, model.Encode(prompt), 6, 0, 0), toks, "prompt %q", prompt)
	return ev.Timing
}

// With a Router, each admitted request is prefilled where it decides: a
// short prompt here (no fetch), a long one remotely (a fetch, a handoff
// time), a long one here too while no prefill instance is known; the output
// is the same either way, and every decision is counted by route and reason.
func TestSchedulerRoutesPrefill(t *testing.T) {
	pre := newScheduler(t, Config{Role: RolePrefill}, newRanks(t, rankOpts{ranks: 1, batch: 2}))
	dranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
	src := &countingSource{gateSource: gateSource{pre: pre, dst: dranks}}
	var instances atomic.Int32
	instances.Store(1)
	m := NewMetrics(prometheus.NewRegistry())
	router := AutoRouter{
		Policy: AutoPolicy{MinRemoteTokens: 20, MaxPrefillQueue: 1},
		Load:   func() PrefillLoad { return PrefillLoad{Instances: int(instances.Load()), Rows: 2} },
	}
	dec := newScheduler(t, Config{Source: src, Router: router, Metrics: m}, dranks)
	const short, long = "Hello", "a prompt long enough to be prefilled remotely"

	tm := generateChecked(t, dec, short)
	require.Zero(t, src.fetches.Load(), "a short prompt is prefilled here")
	require.Zero(t, tm.Handoff)
	require.Equal(t, 1.0, routes(t, m, RouteLocal, ReasonShortPrompt))

	tm = generateChecked(t, dec, long)
	require.Equal(t, int32(1), src.fetches.Load(), "a long prompt is fetched")
	require.Greater(t, tm.Handoff, time.Duration(0))
	require.Equal(t, 1.0, routes(t, m, RouteRemote, ReasonLongPrompt))

	instances.Store(0)
	tm = generateChecked(t, dec, long)
	require.Equal(t, int32(1), src.fetches.Load(), "no prefill instance: prefilled here")
	require.Zero(t, tm.Handoff)
	require.Equal(t, 1.0, routes(t, m, RouteLocal, ReasonNoPrefill))
	require.Zero(t, routes(t, m, RouteLocal, ReasonPrefillBusy), "the series exist at 0")
}

// A remote prefill that is refused (no prefill worker answered, none had
// room) runs here instead, on the resources the fetch was given: the
// request succeeds with the same output, and the fallback is counted.
func TestSchedulerRefusedRemotePrefillRunsHere(t *testing.T) {
	dranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
	src := &countingSource{refuse: true}
	m := NewMetrics(prometheus.NewRegistry())
	router := AutoRouter{
		Policy: AutoPolicy{MinRemoteTokens: 1, MaxPrefillQueue: 1},
		Load:   func() PrefillLoad { return PrefillLoad{Instances: 1, Rows: 2} },
	}
	dec := newScheduler(t, Config{Source: src, Router: router, Metrics: m}, dranks)
	for _, p := range testPrompts[:3] {
		generateChecked(t, dec, p)
	}
	require.Equal(t, int32(3), src.fetches.Load())
	require.Equal(t, 3.0, routes(t, m, RouteRemote, ReasonLongPrompt))
	require.Equal(t, 3.0, routes(t, m, RouteLocal, ReasonRemoteRefused))
	require.Equal(t, 3.0, counterValue(t, m.Transfers.WithLabelValues(string(RoleDecode), TransferRefused)))
	require.Equal(t, 3.0, counterValue(t, m.Requests.WithLabelValues(string(RoleDecode), ResultOK)))
}

// A remote prefill that failed mid-way, leaving garbage in the request's
// KV runs and Mamba row, runs here from scratch: the output is the
// reference's (the row is zeroed, every KV position read is written first),
// and the fallback is counted apart from refusals.
func TestSchedulerFailedRemotePrefillRunsHere(t *testing.T) {
	dranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
	src := &countingSource{fail: true, gateSource: gateSource{dst: dranks}}
	m := NewMetrics(prometheus.NewRegistry())
	router := AutoRouter{
		Policy: AutoPolicy{MinRemoteTokens: 1, MaxPrefillQueue: 1},
		Load:   func() PrefillLoad { return PrefillLoad{Instances: 1, Rows: 2} },
	}
	dec := newScheduler(t, Config{Source: src, Router: router, Metrics: m}, dranks)
	for _, p := range testPrompts[:3] {
		generateChecked(t, dec, p)
	}
	require.Equal(t, int32(3), src.fetches.Load())
	require.Equal(t, 3.0, routes(t, m, RouteLocal, ReasonRemoteFailed))
	require.Zero(t, routes(t, m, RouteLocal, ReasonRemoteRefused))
	require.Equal(t, 3.0, counterValue(t, m.Transfers.WithLabelValues(string(RoleDecode), TransferFailed)))
	require.Equal(t, 3.0, counterValue(t, m.Requests.WithLabelValues(string(RoleDecode), ResultOK)))

	// Without a Router the failure is the request's.
	pranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
	plain := newScheduler(t, Config{Source: &countingSource{fail: true, gateSource: gateSource{dst: pranks}}}, pranks)
	st, err := plain.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("Hello"), MaxTokens: 2})
	require.NoError(t, err)
	_, ev := drainStream(t, st)
	require.ErrorIs(t, ev.Err, ErrTransferFailed)
}

// Without a Router a remote scheduler fetches every request and fails a
// refused one, as before; a Router needs a CacheSource.
func TestSchedulerWithoutRouterFailsRefused(t *testing.T) {
	dranks := newRanks(t, rankOpts{ranks: 1, batch: 2})
	dec := newScheduler(t, Config{Source: &countingSource{refuse: true}}, dranks)
	st, err := dec.Generate(context.Background(), GenerateRequest{Prompt: model.Encode("Hello"), MaxTokens: 2})
	require.NoError(t, err)
	_, ev := drainStream(t, st)
	require.ErrorIs(t, ev.Err, ErrTransferRefused)

	_, err = NewScheduler(Config{Role: RoleDecode, Router: AutoRouter{}}, newRanks(t, rankOpts{ranks: 1, batch: 1}))
	require.ErrorIs(t, err, ErrInvalidConfig)
}
