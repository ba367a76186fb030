package reshard_test

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/reshard"
)

// A Mamba2 model with 8 heads and 1 group, prefilled at TP 2 and decoded
// at TP 1: both prefill shards hold the group, and only shard 0 writes it.
// A layer's row is x [8 heads] | B [4] | C [4] | ssm [8 heads × 4] bytes;
// a TP-2 shard's holds 4 heads. Shard 0 writes its x heads, then B, C and
// its SSM heads as one copy (contiguous on both sides); shard 1 its x and
// SSM heads. Each copy repeats over the 2 layers ("×2") at the two rows'
// strides.
func ExampleNew() {
	m := mambacache.Config{Layers: 2, DState: 4, DConv: 2, Heads: 8, HeadDim: 1, NGroups: 1,
		ConvElemSize: 1, SSMElemSize: 1, ConvLayout: mambacache.ConvXBC}
	p, err := reshard.New(reshard.Mamba(m), 2, 1)
	if err != nil {
		panic(err)
	}
	fmt.Println(p)
	// Output:
	// mamba 2→1 (unit 56→96 bytes)
	//   0→0: [0→0 4×2 (28/48) 4→8 24×2 (28/48)]
	//   1→0: [0→4 4×2 (28/48) 12→32 16×2 (28/48)]
}

// Shapes that do not split are refused by name, before any byte moves.
func ExampleNew_refused() {
	kv := kvcache.Config{Layers: 4, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 32}
	_, err := reshard.New(reshard.KV(kv), 4, 6)
	fmt.Println(errors.Is(err, reshard.ErrIndivisible))
	fmt.Println(err)
	// Output:
	// true
	// destination: reshard: dimension does not divide the tensor-parallel size: kv section kv: 8 kv heads over TP 6 (TP must divide them or be a multiple of them)
}
