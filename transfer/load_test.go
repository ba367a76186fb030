package transfer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/transfer/wire"
)

func TestDecoderPrefillLoad(t *testing.T) {
	now := time.Now()
	inst := func(id, fp string, inflight, rows int, draining bool) wire.Instance {
		return wire.Instance{ID: id, Role: wire.RolePrefill, Fingerprint: fp, Updated: now.UnixNano(), Draining: draining,
			Capacity: wire.Capacity{Inflight: inflight, Rows: rows}}
	}
	tests := []struct {
		name  string
		insts []wire.Instance
		mine  map[string]int // this decoder's calls in flight, by target
		gone  []string
		want  PrefillLoad
	}{
		{name: "none", want: PrefillLoad{}},
		{name: "one idle", insts: []wire.Instance{inst("p1", "fp", 0, 8, false)}, want: PrefillLoad{Instances: 1, Rows: 8}},
		{
			name:  "the least loaded, with its rows",
			insts: []wire.Instance{inst("p1", "fp", 5, 8, false), inst("p2", "fp", 3, 4, false)},
			want:  PrefillLoad{Instances: 2, Inflight: 3, Rows: 4},
		},
		{
			name:  "own calls since the heartbeat count",
			insts: []wire.Instance{inst("p1", "fp", 5, 8, false), inst("p2", "fp", 3, 4, false)},
			mine:  map[string]int{"p2": 4},
			want:  PrefillLoad{Instances: 2, Inflight: 5, Rows: 8},
		},
		{
			name:  "other layouts and draining ones are not usable",
			insts: []wire.Instance{inst("p1", "other", 0, 8, false), inst("p2", "fp", 0, 8, true), inst("p3", "fp", 7, 2, false)},
			want:  PrefillLoad{Instances: 1, Inflight: 7, Rows: 2},
		},
		{
			name:  "an instance reported gone is not usable",
			insts: []wire.Instance{inst("p1", "fp", 0, 8, false)},
			gone:  []string{"p1"},
			want:  PrefillLoad{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := &Decoder{cfg: DecoderConfig{Fingerprint: "fp"}, calls: map[string]*call{}}
			reg := &Registry{cfg: RegistryConfig{TTL: time.Hour}, entries: map[string]wire.Instance{}, seen: map[string]time.Time{}}
			for _, in := range tt.insts {
				reg.entries[in.ID] = in
				reg.seen[in.ID] = now
			}
			d.reg = reg
			n := 0
			for target, k := range tt.mine {
				for range k {
					n++
					d.calls[string(rune('a'+n))] = &call{target: target}
				}
			}
			for _, id := range tt.gone {
				d.writerGone(id, d.entriesOf(id), d.entriesOf(id))
			}
			require.Equal(t, tt.want, d.PrefillLoad(now))
		})
	}
}
