package hybrid

import (
	"errors"
	"sync"
	"testing"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/stretchr/testify/require"
)

// TestConcurrentADPPad has several goroutines fill the pools with requests
// while another pads with the ADP dummy: the pad never fails, whatever the
// interleaving. Run with -race.
func TestConcurrentADPPad(t *testing.T) {
	m := newManager(t, testConfig(2, 6, true))
	idle := m.Stats()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range uint64(3) {
		wg.Go(func() {
			for i := range uint64(2000) {
				id := (g+1)<<32 | i
				_, err := m.Prepare(id, int(i%24)+1)
				if errors.Is(err, kvcache.ErrNoFreeBlocks) || errors.Is(err, mambacache.ErrNoFreeRows) {
					continue
				}
				if err == nil {
					err = m.Grow(id, int(i%24)+5)
					if errors.Is(err, kvcache.ErrNoFreeBlocks) {
						err = nil
					}
				}
				if err == nil {
					err = m.Free(id)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Go(func() {
		for range 2000 {
			err := m.AddDummy(mambacache.ADPDummyID)
			if err == nil {
				err = m.Free(mambacache.ADPDummyID)
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
	require.Equal(t, idle, m.Stats())
}
