package service

import (
	"sync/atomic"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker"
	"github.com/handoff-io/handoff/worker/config"
)

// layerwiseOf is cfg's --layerwise (validated by config.Parse).
func layerwiseOf(cfg config.Config) transfer.Layerwise {
	l, _ := transfer.ParseLayerwise(cfg.Layerwise)
	return l
}

var _ transfer.LayerwiseJob = (*prefillLease)(nil)

// Stream implements transfer.LayerwiseJob.
func (l *prefillLease) Stream(sink func([]transfer.Piece)) { l.parts.sink.Store(&sink) }

// partSink turns the parts of a prefill job's cache that compute finished
// (worker.Part, on the scheduler's goroutine) into pieces of its write, for
// the prefiller's stream once it asked for them (Stream).
type partSink struct {
	n    *node
	sink atomic.Pointer[func([]transfer.Piece)]
	buf  []transfer.Piece // the scheduler's goroutine only
}

func (s *partSink) part(p worker.Part) {
	f := s.sink.Load()
	if f == nil {
		return
	}
	tr := s.n.tranks[p.Rank]
	if tr.TP() > 1 {
		// A TP shard group's write is resharded, not the cache in this
		// order: it goes in one write after prefill (not streamed yet).
		return
	}
	kvID, mID := tr.RegionIDs()
	s.buf = piecesOf(s.buf[:0], tr.Manager().KV().Config(), tr.Manager().Mamba().Config(), kvID, mID, p)
	(*f)(s.buf)
}

// piecesOf appends the pieces of the cache that p names, numbered as the
// whole write of the request's cache sends it (transfer.Prefilled.Source:
// its blocks in token order, then its Mamba row). The arena is block-major
// (kvcache): a block holds, per layer, K then V, each [slot][head][dim], so
// an attention layer's slots [s0, s1) of one block are two pieces (K, V),
// or one when the whole block is final; once the prompt is done (p.End)
// its last block goes up to its end, slots past the prompt included, as a
// whole write sends them. A Mamba layer is one contiguous piece of the row.
func piecesOf(dst []transfer.Piece, kv kvcache.Config, m mambacache.Config, kvID, mID rdma.RegionID, p worker.Part) []transfer.Piece {
	block := uint64(kv.BlockBytes())
	if p.Kind == 'M' {
		x := m.LayerExtent(p.Row, p.MambaLayer)
		at := uint64(len(p.Blocks))*block + uint64(p.MambaLayer)*uint64(m.LayerBytes())
		return append(dst, transfer.Piece{At: at, Src: rdma.Extent{Region: mID, Offset: uint64(x.Offset), Length: uint64(x.Length)}})
	}
	if p.Kind != '*' {
		return dst
	}
	t := kv.TokensPerBlock
	tok := uint64(kv.KVHeads * kv.HeadDim * kv.ElemSize) // one slot of K (or V)
	half := uint64(t) * tok
	end := p.To
	if p.End {
		end = (p.To + t - 1) / t * t
	}
	for k := p.From / t; k*t < end && k < len(p.Blocks); k++ {
		s0 := uint64(max(p.From, k*t) - k*t)
		s1 := uint64(min(end, (k+1)*t) - k*t)
		x := kv.KVExtent(p.Blocks[k], p.KVLayer, kvcache.K)
		inBlock := uint64(x.Offset) - uint64(kv.BlockExtent(p.Blocks[k]).Offset)
		at := uint64(k)*block + inBlock
		src := uint64(x.Offset)
		if s0 == 0 && s1 == uint64(t) {
			dst = append(dst, transfer.Piece{At: at, Src: rdma.Extent{Region: kvID, Offset: src, Length: 2 * half}})
			continue
		}
		n := (s1 - s0) * tok
		dst = append(dst,
			transfer.Piece{At: at + s0*tok, Src: rdma.Extent{Region: kvID, Offset: src + s0*tok, Length: n}},
			transfer.Piece{At: at + half + s0*tok, Src: rdma.Extent{Region: kvID, Offset: src + half + s0*tok, Length: n}})
	}
	return dst
}
