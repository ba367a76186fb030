package mambacache_test

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/mambacache"
)

// The scenario TensorRT-LLM PR #14853 fixed: max_batch_size 1 with
// attention DP in disaggregated serving. A request whose state is in
// transfer holds the only real row while its rank pads with the ADP dummy.
func Example() {
	cfg := mambacache.Config{
		Layers: 4, DState: 16, DConv: 4, Heads: 8, HeadDim: 16, NGroups: 1,
		ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 1, AttentionDP: true,
	}
	pool, err := mambacache.New(cfg)
	if err != nil {
		panic(err)
	}
	fmt.Println("rows", cfg.TotalRows(), "capacity", pool.Capacity())

	inTransfer, _ := pool.Allocate(100)
	dummy, err := pool.AddDummy(mambacache.ADPDummyID)
	fmt.Println("request row", inTransfer, "dummy row", dummy, err, "reserved", pool.IsReserved(dummy))
	_ = pool.Free(mambacache.ADPDummyID)
	fmt.Println("free list after the dummy:", pool.FreeList(nil))

	// Without attention DP, id 0 is an ordinary dummy and needs a real row.
	cfg.AttentionDP = false
	old, _ := mambacache.New(cfg)
	_, _ = old.Allocate(100)
	_, err = old.AddDummy(mambacache.ADPDummyID)
	fmt.Println(errors.Is(err, mambacache.ErrNoFreeRows))
	// Output:
	// rows 3 capacity 1
	// request row 0 dummy row 1 <nil> reserved true
	// free list after the dummy: []
	// true
}

func ExampleConfig_ConvExtent() {
	cfg := mambacache.Config{
		Layers: 2, DState: 4, DConv: 4, Heads: 2, HeadDim: 4, NGroups: 1,
		ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 2,
	}
	fmt.Println("row bytes", cfg.RowBytes())
	for _, s := range []mambacache.Section{mambacache.SectionX, mambacache.SectionB, mambacache.SectionC} {
		fmt.Printf("row 1 layer 1 conv %v: %+v\n", s, cfg.ConvExtent(1, 1, s))
	}
	fmt.Printf("row 1 layer 1 ssm: %+v\n", cfg.SSMExtent(1, 1))
	// Output:
	// row bytes 448
	// row 1 layer 1 conv x: {Offset:672 Length:48}
	// row 1 layer 1 conv B: {Offset:720 Length:24}
	// row 1 layer 1 conv C: {Offset:744 Length:24}
	// row 1 layer 1 ssm: {Offset:768 Length:128}
}
