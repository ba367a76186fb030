package kvcache

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestConcurrentUse hammers one pool from several goroutines (each with its
// own ids) and checks it ends idle and consistent. Run with -race.
func TestConcurrentUse(t *testing.T) {
	p := newPool(t, 64)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range uint64(4) {
		wg.Go(func() {
			var runs []Run
			for i := range uint64(2000) {
				id := g<<32 | i
				err := p.Allocate(id, int(i%40)+1)
				if errors.Is(err, ErrNoFreeBlocks) {
					continue
				}
				if err == nil {
					err = p.Grow(id, int(i%40)+9)
				}
				if err == nil || errors.Is(err, ErrNoFreeBlocks) {
					runs, err = p.Runs(id, runs[:0])
				}
				if err == nil {
					err = p.Free(id)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, p.checkInvariants())
	require.Equal(t, 64, p.FreeBlocks())
	require.Equal(t, 1, p.FreeExtents())
}
