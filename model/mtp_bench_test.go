package model_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// BenchmarkDraftHead: four drafts of tiny-hybrid's head at position 384
// against one decode step there (the verification runs five of those).
func BenchmarkDraftHead(b *testing.B) {
	e := lookup(b, model.TinyHybrid+"?mtp=1")
	spec := e.Spec()
	n := 384
	nb := (n + 16) / spec.KV.TokensPerBlock
	a := newArenas(b, spec, nb, 1)
	c := a.cache(0, blockRange(0, nb)...)
	_, err := e.Prefill(c, prompt(n, 1))
	require.NoError(b, err)
	b.Run("draft4", func(b *testing.B) {
		var dst []int32
		for b.Loop() {
			dst, err = model.Draft(context.Background(), e, c, 'a', n, 4, dst[:0])
			if err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode", func(b *testing.B) {
		for b.Loop() {
			if _, err := e.Decode(c, 'a', n); err != nil {
				b.Fatal(err)
			}
		}
	})
}
