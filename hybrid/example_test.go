package hybrid_test

import (
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

func Example() {
	m, err := hybrid.New(hybrid.Config{
		KV: kvcache.Config{Layers: 2, KVHeads: 2, HeadDim: 64, ElemSize: 2, TokensPerBlock: 16, Blocks: 8},
		Mamba: mambacache.Config{
			Layers: 2, DState: 16, DConv: 4, Heads: 4, HeadDim: 16, NGroups: 1,
			ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 1, AttentionDP: true,
		},
	})
	if err != nil {
		panic(err)
	}
	rows, blocks := m.Capacity()
	fmt.Println("capacity", rows, "rows", blocks, "blocks")

	// Decode admits a request and prepares its destination before the transfer.
	fmt.Println("admit 112 tokens:", m.CanAdmit(112), "128 tokens:", m.CanAdmit(128))
	res, err := m.Prepare(100, 112)
	fmt.Println(res.Row, res.Runs, err)

	// While it is in transfer the rank is idle and pads: the dummy still fits.
	fmt.Println("pad:", m.AddDummy(mambacache.ADPDummyID))
	s := m.Stats()
	fmt.Printf("rows free %d used %d reserved %d, blocks free %d used %d headroom %d, requests %d\n",
		s.RowsFree, s.RowsUsed, s.RowsReserved, s.BlocksFree, s.BlocksUsed, s.BlocksHeadroom, s.Requests)
	_ = m.Free(mambacache.ADPDummyID)
	_ = m.Free(100)
	s = m.Stats()
	fmt.Printf("rows free %d used %d reserved %d, blocks free %d used %d headroom %d, requests %d\n",
		s.RowsFree, s.RowsUsed, s.RowsReserved, s.BlocksFree, s.BlocksUsed, s.BlocksHeadroom, s.Requests)
	// Output:
	// capacity 1 rows 7 blocks
	// admit 112 tokens: true 128 tokens: false
	// 0 [{0 7}] <nil>
	// pad: <nil>
	// rows free 0 used 1 reserved 2, blocks free 0 used 8 headroom 0, requests 2
	// rows free 1 used 0 reserved 2, blocks free 8 used 0 headroom 1, requests 0
}
