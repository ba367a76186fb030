package worker

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestAutoPolicyDecide(t *testing.T) {
	p := AutoPolicy{MinRemoteTokens: 512, MaxPrefillQueue: 4}
	idle := PrefillLoad{Instances: 2, Inflight: 0, Rows: 8}
	quiet := LocalLoad{Running: 3, Rows: 16} // below half its rows
	busy := LocalLoad{Running: 8, Rows: 16}  // at half its rows
	tests := []struct {
		name   string
		tokens int
		load   PrefillLoad
		local  LocalLoad
		remote bool
		reason string
	}{
		{"long prompt, idle prefill: remote", 4096, idle, quiet, true, ReasonLongPrompt},
		{"at the threshold: remote", 512, idle, quiet, true, ReasonLongPrompt},
		{"one token short of it: local", 511, idle, quiet, false, ReasonShortPrompt},
		{"one token: local", 1, idle, quiet, false, ReasonShortPrompt},
		{"no prefill instance: local, even a long prompt", 4096, PrefillLoad{}, quiet, false, ReasonNoPrefill},
		{"no prefill instance wins over a short prompt", 10, PrefillLoad{}, quiet, false, ReasonNoPrefill},
		{"a full batch is no queue: remote", 4096, PrefillLoad{Instances: 1, Inflight: 8, Rows: 8}, quiet, true, ReasonLongPrompt},
		{"queue below the bound: remote", 4096, PrefillLoad{Instances: 1, Inflight: 11, Rows: 8}, quiet, true, ReasonLongPrompt},
		{"queue at the bound: local", 4096, PrefillLoad{Instances: 1, Inflight: 12, Rows: 8}, quiet, false, ReasonPrefillBusy},
		{"no rows announced: in flight is the queue", 4096, PrefillLoad{Instances: 1, Inflight: 4}, quiet, false, ReasonPrefillBusy},
		{"short prompt on a quiet rank is local before the queue is looked at", 100, PrefillLoad{Instances: 1, Inflight: 50, Rows: 8}, quiet, false, ReasonShortPrompt},
		{"short prompt on a busy rank: remote", 100, idle, busy, true, ReasonDecodeBusy},
		{"one request fewer than half the rows: local", 100, idle, LocalLoad{Running: 7, Rows: 16}, false, ReasonShortPrompt},
		{"short prompt on a busy rank, prefill queue at the bound: local", 100, PrefillLoad{Instances: 1, Inflight: 12, Rows: 8}, busy, false, ReasonShortPrompt},
		{"short prompt on a busy rank, no prefill instance: local", 100, PrefillLoad{}, busy, false, ReasonNoPrefill},
		{"a busy rank changes nothing for a long prompt", 4096, idle, busy, true, ReasonLongPrompt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := p.Decide(tt.tokens, tt.load, tt.local)
			require.Equal(t, RouteDecision{Remote: tt.remote, Reason: tt.reason}, d)
			if tt.remote {
				require.Equal(t, RouteRemote, d.Route())
			} else {
				require.Equal(t, RouteLocal, d.Route())
			}
		})
	}
}

func TestAutoPolicyZeroThresholdSendsEveryPromptRemote(t *testing.T) {
	p := AutoPolicy{MinRemoteTokens: 0, MaxPrefillQueue: 1}
	require.True(t, p.Decide(1, PrefillLoad{Instances: 1, Rows: 8}, LocalLoad{}).Remote)
	require.False(t, p.Decide(1, PrefillLoad{Instances: 1, Inflight: 9, Rows: 8}, LocalLoad{}).Remote)
}

func TestAutoPolicyMaxLocalRunning(t *testing.T) {
	p := AutoPolicy{MinRemoteTokens: 512, MaxPrefillQueue: 4, MaxLocalRunning: 2}
	l := PrefillLoad{Instances: 1, Rows: 8}
	require.False(t, p.Decide(10, l, LocalLoad{Running: 1, Rows: 64}).Remote, "below the set bound")
	require.Equal(t, RouteDecision{Remote: true, Reason: ReasonDecodeBusy}, p.Decide(10, l, LocalLoad{Running: 2, Rows: 64}))
	// 0: half the rows, rounded up; a rank with no rows is never busy.
	p.MaxLocalRunning = 0
	require.False(t, p.Decide(10, l, LocalLoad{Running: 1, Rows: 3}).Remote)
	require.True(t, p.Decide(10, l, LocalLoad{Running: 2, Rows: 3}).Remote)
	require.False(t, p.Decide(10, l, LocalLoad{Running: 5}).Remote)
}

func TestAutoPolicyValidate(t *testing.T) {
	require.NoError(t, AutoPolicy{MinRemoteTokens: DefaultAutoMinRemoteTokens, MaxPrefillQueue: DefaultAutoMaxPrefillQueue}.Validate())
	require.ErrorIs(t, AutoPolicy{MinRemoteTokens: -1, MaxPrefillQueue: 1}.Validate(), ErrInvalidConfig)
	require.ErrorIs(t, AutoPolicy{MinRemoteTokens: 1, MaxPrefillQueue: 0}.Validate(), ErrInvalidConfig)
	require.ErrorIs(t, AutoPolicy{MinRemoteTokens: 1, MaxPrefillQueue: 1, MaxLocalRunning: -1}.Validate(), ErrInvalidConfig)
}

func TestAutoRouterReadsTheLoadAtEachDecision(t *testing.T) {
	load := PrefillLoad{Instances: 1, Rows: 1}
	r := AutoRouter{Policy: AutoPolicy{MinRemoteTokens: 16, MaxPrefillQueue: 2}, Load: func() PrefillLoad { return load }}
	require.Equal(t, RouteDecision{Remote: true, Reason: ReasonLongPrompt}, r.Route(16, LocalLoad{}))
	load.Inflight = 3
	require.Equal(t, RouteDecision{Reason: ReasonPrefillBusy}, r.Route(16, LocalLoad{}))
	load = PrefillLoad{}
	require.Equal(t, RouteDecision{Reason: ReasonNoPrefill}, r.Route(16, LocalLoad{}))
}
