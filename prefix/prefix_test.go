package prefix

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestChainNamesEveryFullBlockByItsWholePrefix(t *testing.T) {
	root := Salt("m")
	a := Chain(nil, root, []int32{1, 2, 3, 4, 5}, 2)
	require.Len(t, a, 2, "the partial last block has no name")
	b := Chain(nil, root, []int32{1, 2, 3, 4, 6, 7}, 2)
	require.Len(t, b, 3)
	require.Equal(t, a, b[:2], "equal prefixes, equal names")
	c := Chain(nil, root, []int32{9, 2, 3, 4}, 2)
	require.NotEqual(t, a[1], c[1], "a block's name depends on every earlier token")
	require.NotEqual(t, a[0], Chain(nil, Salt("other"), []int32{1, 2}, 2)[0], "the salt changes every name")
	require.Equal(t, root, Parent(root, a, 0))
	require.Equal(t, a[1], Parent(root, a, 2))
}

func TestNextSeparatesTokenBoundaries(t *testing.T) {
	root := Salt("m")
	require.NotEqual(t, Next(root, []int32{1 << 8}), Next(root, []int32{1, 0}))
	require.NotEqual(t, Next(root, nil), Next(root, []int32{0}))
}
