package mambacache

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStateEventsFollowTheReadyCheckpoints: filling records a stored
// event, a duplicate or an aborted fill records nothing, an eviction
// records a removed event naming the evicted prefix, and an overflowing
// journal gives way to the snapshot.
func TestStateEventsFollowTheReadyCheckpoints(t *testing.T) {
	p := newPool(t, ckConfig(1, 2, false))
	fill := func(parent byte, partial []int32, tokens int) (Row, bool) {
		r, evicted, err := p.NewCheckpoint()
		require.NoError(t, err)
		dup, err := p.FillCheckpoint(r, PrefixHash{parent}, partial, tokens)
		require.NoError(t, err)
		require.False(t, dup)
		return r, evicted
	}
	_, _ = fill(1, []int32{7}, 5)
	evs, overflow := p.TakeEvents(nil)
	require.Empty(t, evs, "nothing is recorded unless asked")
	require.False(t, overflow)

	p.RecordEvents(4)
	_, _ = fill(2, nil, 8)
	evs, _ = p.TakeEvents(nil)
	require.Equal(t, []StateEvent{{Stored: true, Parent: PrefixHash{2}, Tokens: 8}}, evs)

	// Both rows ready: a new one evicts the oldest, {1} at 5; an aborted
	// fill records nothing more.
	r, evicted, err := p.NewCheckpoint()
	require.NoError(t, err)
	require.True(t, evicted)
	require.NoError(t, p.AbortCheckpoint(r))
	_, evicted = fill(3, []int32{1, 2}, 6)
	require.False(t, evicted)
	evs, _ = p.TakeEvents(evs[:0])
	require.Equal(t, []StateEvent{
		{Stored: false, Parent: PrefixHash{1}, Partial: []int32{7}, Tokens: 5},
		{Stored: true, Parent: PrefixHash{3}, Partial: []int32{1, 2}, Tokens: 6},
	}, evs)

	// A duplicate fill frees its row and records nothing.
	r, _, err = p.NewCheckpoint() // evicts {2} at 8
	require.NoError(t, err)
	dup, err := p.FillCheckpoint(r, PrefixHash{3}, []int32{1, 2}, 6)
	require.NoError(t, err)
	require.True(t, dup)
	evs, _ = p.TakeEvents(evs[:0])
	require.Equal(t, []StateEvent{{Stored: false, Parent: PrefixHash{2}, Tokens: 8}}, evs)

	p.RecordEvents(1)
	_, _ = fill(4, nil, 4)
	_, _ = fill(5, nil, 4)
	evs, overflow = p.TakeEvents(evs[:0])
	require.True(t, overflow)
	require.Empty(t, evs)
	require.ElementsMatch(t, []StateEvent{
		{Stored: true, Parent: PrefixHash{4}, Tokens: 4},
		{Stored: true, Parent: PrefixHash{5}, Tokens: 4},
	}, p.Snapshot(nil))
	evs, overflow = p.TakeEvents(evs[:0])
	require.False(t, overflow, "a take starts the journal over")
	require.Empty(t, evs)
}
