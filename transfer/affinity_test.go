package transfer

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func affinityTokens(n int, salt int32) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(i)%200 + salt
	}
	return t
}

// A prompt goes to the instance that prefilled its longest remembered
// prefix: a conversation's next turn to its last turn's instance, a
// prompt that shares only a system prompt to whoever prefilled one.
func TestAffinityLongestPrefix(t *testing.T) {
	a := newAffinity("fp", 8)
	turn1 := affinityTokens(300, 0)
	a.remember(turn1, "", "p1")
	id, n := a.lookup(append(turn1[:300:300], affinityTokens(100, 7)...), "")
	require.Equal(t, "p1", id)
	require.Equal(t, 256, n, "the longest prefix named: 4 grains")
	turn2 := append(turn1[:300:300], affinityTokens(200, 7)...)
	a.remember(turn2, "", "p2")
	id, n = a.lookup(append(turn2[:500:500], 1, 2, 3), "")
	require.Equal(t, "p2", id, "the longer prefix wins")
	require.Equal(t, 448, n)
	id, n = a.lookup(append(turn1[:200:200], affinityTokens(300, 99)...), "")
	require.Equal(t, "p2", id, "a shared system prompt finds the instance that last prefilled through it")
	require.Equal(t, 192, n)
	id, _ = a.lookup(affinityTokens(40, 0), "")
	require.Equal(t, "", id, "shorter than a grain")
	a.remember(affinityTokens(40, 0), "", "p3")
	id, _ = a.lookup(affinityTokens(40, 0), "")
	require.Equal(t, "", id, "a prompt shorter than a grain is not remembered")
	require.NotEqual(t, newAffinity("other", 8).names(turn1)[0], a.names(turn1)[0], "names are salted with the layout")
}

// The memory is bounded: the least recently used entry goes first.
func TestAffinityBounded(t *testing.T) {
	a := newAffinity("fp", 2)
	p1, p2, p3 := affinityTokens(64, 1), affinityTokens(64, 2), affinityTokens(64, 3) // one name each
	a.remember(p1, "", "a")
	a.remember(p2, "", "b")
	id, _ := a.lookup(p1, "") // p1 used: p2 is the oldest
	require.Equal(t, "a", id)
	a.remember(p3, "", "c")
	id, _ = a.lookup(p2, "")
	require.Equal(t, "", id)
	id, _ = a.lookup(p1, "")
	require.Equal(t, "a", id)
	require.Equal(t, 2, a.lru.Len())
	require.Len(t, a.byID, 2)
	a.remember(p1, "", "d") // the instance that prefilled it last
	id, _ = a.lookup(p1, "")
	require.Equal(t, "d", id)
}

// A request whose prompt names no remembered prefix goes where its
// prompt_cache_key's last request was prefilled; a prefix wins over a key.
func TestAffinityCacheKey(t *testing.T) {
	a := newAffinity("fp", 16)
	a.remember(affinityTokens(100, 1), "conv-7", "p1")
	id, n := a.lookup(affinityTokens(30, 50), "conv-7")
	require.Equal(t, "p1", id)
	require.Zero(t, n, "no prefix: the key named it")
	id, _ = a.lookup(affinityTokens(30, 50), "conv-8")
	require.Equal(t, "", id)
	a.remember(affinityTokens(100, 2), "", "p2")
	id, n = a.lookup(affinityTokens(100, 2), "conv-7")
	require.Equal(t, "p2", id, "the prompt's own prefix wins")
	require.Equal(t, 64, n)
}
