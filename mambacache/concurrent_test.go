package mambacache

import (
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestConcurrentUse has several goroutines take and return real rows while
// one pads with the ADP dummy: the dummy always gets its reserved row.
// Run with -race.
func TestConcurrentUse(t *testing.T) {
	c := testConfig(3, true)
	p := newPool(t, c)
	adpRow, _ := c.ADPRow()
	var wg sync.WaitGroup
	errs := make(chan error, 5)
	for g := range uint64(4) {
		wg.Go(func() {
			for i := range uint64(3000) {
				id := (g+1)<<32 | i
				r, err := p.Allocate(id)
				if errors.Is(err, ErrNoFreeRows) {
					continue
				}
				if err == nil && p.IsReserved(r) {
					err = errors.New("real request on a reserved row")
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
	wg.Go(func() {
		for range 3000 {
			r, err := p.AddDummy(ADPDummyID)
			if err == nil && r != adpRow {
				err = errors.New("ADP dummy off its row")
			}
			if err == nil {
				err = p.Free(ADPDummyID)
			}
			if err != nil {
				errs <- err
				return
			}
		}
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	free := p.FreeList(nil)
	slices.Sort(free)
	require.Equal(t, []Row{0, 1, 2}, free)
	require.Equal(t, 0, p.Requests())
}
