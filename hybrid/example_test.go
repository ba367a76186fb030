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
	fmt.Printf("%+v\n", m.Stats())
	_ = m.Free(mambacache.ADPDummyID)
	_ = m.Free(100)
	fmt.Printf("%+v\n", m.Stats())
	// Output:
	// capacity 1 rows 7 blocks
	// admit 112 tokens: true 128 tokens: false
	// 0 [{0 7}] <nil>
	// pad: <nil>
	// {RowsFree:0 RowsUsed:1 RowsReserved:2 BlocksFree:0 BlocksUsed:8 BlocksHeadroom:0 Requests:2}
	// {RowsFree:1 RowsUsed:0 RowsReserved:2 BlocksFree:8 BlocksUsed:0 BlocksHeadroom:1 Requests:0}
}
