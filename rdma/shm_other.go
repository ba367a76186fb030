//go:build !linux

package rdma

import (
	"context"
	"time"
)

// shm needs memfd and SCM_RIGHTS; elsewhere the transport is not offered.
const shmSupported = false

type shmServer struct{ path string }

type shmRxState struct{}

func startSHM(e *Engine, path string) (*shmServer, error) { return nil, ErrUnsupported }

func dialSHM(ctx context.Context, e *Engine, peer Descriptor) (link, error) {
	return nil, ErrUnsupported
}

func (s *shmServer) slotFree(id uint64) bool                        { return true }
func (s *shmServer) slotOf(id uint64) int                           { return -1 }
func (s *shmServer) open(g *Grant)                                  {}
func (s *shmServer) release(g *Grant)                               {}
func (s *shmServer) fence(g *Grant, wait time.Duration) bool        { return true }
func (s *shmServer) close()                                         {}
func (s *shmServer) stored(g *Grant) uint64                         { return 0 }
func (s *shmServer) unmap()                                         {}
func (r *shmRxState) closed(err error, hungUp bool)                 {}
func (r *shmRxState) hello(c *rxConn) error                         { return nil }
func (r *shmRxState) commit(g *Grant, h *header, m *Manifest) error { return nil }
