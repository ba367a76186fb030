package transfer

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/transfer/wire"
)

// fakeStates answers Longest from a table: instance -> L (missing: cannot
// tell).
type fakeStates map[string]int

func (f fakeStates) Hits([]int32) map[string]int { return f }

func TestPickByState(t *testing.T) {
	now := time.Now()
	inst := func(id string, inflight, rows int) wire.Instance {
		return wire.Instance{ID: id, Role: wire.RolePrefill, Fingerprint: "fp", Updated: now.UnixNano(),
			Capacity: wire.Capacity{Inflight: inflight, Rows: rows}}
	}
	tests := []struct {
		name   string
		insts  []wire.Instance
		states fakeStates
		cost   float64 // the decoder's c; 0: the prompt's length
		want   string  // "": no instance holds any of the prompt
		held   int
	}{
		{name: "nobody holds anything", insts: []wire.Instance{inst("p1", 0, 4), inst("p2", 0, 4)}, states: fakeStates{"p1": 0, "p2": 0}},
		{name: "the holder, idle", insts: []wire.Instance{inst("p1", 0, 4), inst("p2", 0, 4)}, states: fakeStates{"p1": 0, "p2": 900}, want: "p2", held: 900},
		{name: "the longest state", insts: []wire.Instance{inst("p1", 0, 4), inst("p2", 0, 4)}, states: fakeStates{"p1": 500, "p2": 900}, want: "p2", held: 900},
		{
			name:  "the holder although busier, when what others would recompute costs more than its load",
			insts: []wire.Instance{inst("p1", 0, 4), inst("p2", 2, 4)}, states: fakeStates{"p2": 900}, cost: 100,
			want: "p2", held: 900,
		},
		{
			name:  "not a holder whose load costs more than recomputing elsewhere",
			insts: []wire.Instance{inst("p1", 0, 4), inst("p2", 3, 4)}, states: fakeStates{"p1": 0, "p2": 600}, cost: 300,
		},
		{
			name:  "not a holder with no free row while another has one",
			insts: []wire.Instance{inst("p1", 0, 4), inst("p2", 4, 4)}, states: fakeStates{"p2": 999}, cost: 1,
		},
		{
			name:  "an instance out of sync is weighed by load alone",
			insts: []wire.Instance{inst("p1", 0, 4), inst("p2", 0, 4)}, states: fakeStates{"p1": 400},
			want: "p1", held: 400,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := &Decoder{cfg: DecoderConfig{Fingerprint: "fp", States: tt.states, Logger: slog.New(slog.DiscardHandler)}, calls: map[string]*call{}, stateCost: tt.cost}
			reg := &Registry{cfg: RegistryConfig{TTL: time.Hour}, entries: map[string]wire.Instance{}, seen: map[string]time.Time{}}
			for _, in := range tt.insts {
				reg.entries[in.ID] = in
				reg.seen[in.ID] = now
			}
			d.reg = reg
			got, held, ok := d.pickByState(make([]int32, 1000), nil)
			require.Equal(t, tt.want != "", ok)
			require.Equal(t, tt.want, got.ID)
			require.Equal(t, tt.held, held)
		})
	}
}

// TestPickByStateLearnsTheCostOfLoad: c follows the tokens the chosen
// instances compute, so once turns hit, a busy holder wins over an idle
// instance that would recompute the whole prompt.
func TestPickByStateLearnsTheCostOfLoad(t *testing.T) {
	now := time.Now()
	d := &Decoder{cfg: DecoderConfig{Fingerprint: "fp", States: fakeStates{"p2": 990}, Logger: slog.New(slog.DiscardHandler)}, calls: map[string]*call{}}
	reg := &Registry{cfg: RegistryConfig{TTL: time.Hour}, entries: map[string]wire.Instance{}, seen: map[string]time.Time{}}
	for _, in := range []wire.Instance{
		{ID: "p1", Role: wire.RolePrefill, Fingerprint: "fp", Updated: now.UnixNano(), Capacity: wire.Capacity{Rows: 8}},
		{ID: "p2", Role: wire.RolePrefill, Fingerprint: "fp", Updated: now.UnixNano(), Capacity: wire.Capacity{Inflight: 2, Rows: 8}},
	} {
		reg.entries[in.ID] = in
		reg.seen[in.ID] = now
	}
	d.reg = reg
	_, _, ok := d.pickByState(make([]int32, 1000), nil)
	require.False(t, ok, "at first a request in flight is taken to cost a whole prompt")
	for range 100 {
		d.pickByState(make([]int32, 1000), nil)
	}
	got, _, ok := d.pickByState(make([]int32, 1000), nil)
	require.True(t, ok)
	require.Equal(t, "p2", got.ID)
	require.Less(t, d.stateCost, 20.0)
}
