package worker

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestAutoPolicyDecide(t *testing.T) {
	p := AutoPolicy{MinRemoteTokens: 512, MaxPrefillQueue: 4}
	idle := PrefillLoad{Instances: 2, Inflight: 0, Rows: 8}
	tests := []struct {
		name   string
		tokens int
		load   PrefillLoad
		remote bool
		reason string
	}{
		{"long prompt, idle prefill: remote", 4096, idle, true, ReasonLongPrompt},
		{"at the threshold: remote", 512, idle, true, ReasonLongPrompt},
		{"one token short of it: local", 511, idle, false, ReasonShortPrompt},
		{"one token: local", 1, idle, false, ReasonShortPrompt},
		{"no prefill instance: local, even a long prompt", 4096, PrefillLoad{}, false, ReasonNoPrefill},
		{"no prefill instance wins over a short prompt", 10, PrefillLoad{}, false, ReasonNoPrefill},
		{"a full batch is no queue: remote", 4096, PrefillLoad{Instances: 1, Inflight: 8, Rows: 8}, true, ReasonLongPrompt},
		{"queue below the bound: remote", 4096, PrefillLoad{Instances: 1, Inflight: 11, Rows: 8}, true, ReasonLongPrompt},
		{"queue at the bound: local", 4096, PrefillLoad{Instances: 1, Inflight: 12, Rows: 8}, false, ReasonPrefillBusy},
		{"no rows announced: in flight is the queue", 4096, PrefillLoad{Instances: 1, Inflight: 4}, false, ReasonPrefillBusy},
		{"short prompt is local before the queue is looked at", 100, PrefillLoad{Instances: 1, Inflight: 50, Rows: 8}, false, ReasonShortPrompt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := p.Decide(tt.tokens, tt.load)
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
	require.True(t, p.Decide(1, PrefillLoad{Instances: 1, Rows: 8}).Remote)
	require.False(t, p.Decide(1, PrefillLoad{Instances: 1, Inflight: 9, Rows: 8}).Remote)
}

func TestAutoPolicyValidate(t *testing.T) {
	require.NoError(t, AutoPolicy{MinRemoteTokens: DefaultAutoMinRemoteTokens, MaxPrefillQueue: DefaultAutoMaxPrefillQueue}.Validate())
	require.ErrorIs(t, AutoPolicy{MinRemoteTokens: -1, MaxPrefillQueue: 1}.Validate(), ErrInvalidConfig)
	require.ErrorIs(t, AutoPolicy{MinRemoteTokens: 1, MaxPrefillQueue: 0}.Validate(), ErrInvalidConfig)
}

func TestAutoRouterReadsTheLoadAtEachDecision(t *testing.T) {
	load := PrefillLoad{Instances: 1, Rows: 1}
	r := AutoRouter{Policy: AutoPolicy{MinRemoteTokens: 16, MaxPrefillQueue: 2}, Load: func() PrefillLoad { return load }}
	require.Equal(t, RouteDecision{Remote: true, Reason: ReasonLongPrompt}, r.Route(16))
	load.Inflight = 3
	require.Equal(t, RouteDecision{Reason: ReasonPrefillBusy}, r.Route(16))
	load = PrefillLoad{}
	require.Equal(t, RouteDecision{Reason: ReasonNoPrefill}, r.Route(16))
}
