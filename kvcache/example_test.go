package kvcache_test

import (
	"errors"
	"fmt"

	"github.com/handoff-io/handoff/kvcache"
)

func Example() {
	cfg := kvcache.Config{Layers: 2, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 32, Blocks: 64}
	pool, err := kvcache.New(cfg)
	if err != nil {
		panic(err)
	}
	arena := make([]byte, cfg.ArenaBytes()) // the caller owns the memory

	// A 100-token prompt takes ceil(100/32) = 4 blocks, one run on an idle pool.
	if err := pool.Allocate(7, 100); err != nil {
		panic(err)
	}
	runs, _ := pool.Runs(7, nil)
	for _, r := range runs {
		e := cfg.RunExtent(r)
		fmt.Printf("run %v: bytes [%d, %d) of %d\n", r, e.Offset, e.End(), len(arena))
	}
	// Decode appends tokens; the run grows in place.
	for tokens := 101; tokens <= 130; tokens++ {
		if err := pool.Grow(7, tokens); err != nil {
			panic(err)
		}
	}
	runs, _ = pool.Runs(7, runs[:0])
	fmt.Println("after decode:", runs, "free", pool.FreeBlocks())

	err = pool.Allocate(8, 61*32)
	fmt.Println(errors.Is(err, kvcache.ErrNoFreeBlocks))
	_ = pool.Free(7)
	fmt.Println("free", pool.FreeBlocks())
	// Output:
	// run {0 4}: bytes [0, 1048576) of 16777216
	// after decode: [{0 5}] free 59
	// true
	// free 64
}

func ExampleConfig_KVExtent() {
	cfg := kvcache.Config{Layers: 2, KVHeads: 1, HeadDim: 4, ElemSize: 2, TokensPerBlock: 2, Blocks: 4}
	fmt.Println("block bytes", cfg.BlockBytes())
	for _, kv := range []kvcache.KV{kvcache.K, kvcache.V} {
		fmt.Printf("block 1 layer 1 %v: %+v\n", kv, cfg.KVExtent(1, 1, kv))
	}
	fmt.Println("token slot 1 of it:", cfg.TokenOffset(1, 1, kvcache.V, 1, 0))
	// Output:
	// block bytes 64
	// block 1 layer 1 K: {Offset:96 Length:16}
	// block 1 layer 1 V: {Offset:112 Length:16}
	// token slot 1 of it: 120
}
