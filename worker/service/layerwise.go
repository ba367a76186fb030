package service

import (
	"sync/atomic"

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
// (worker.Part, on the scheduler's goroutine) into pieces of its write to
// a TP-to receiver (transfer.RankRegions.Pieces, resharded when the two
// sides' TP sizes differ), for the prefiller's stream once it asked for
// them (Stream).
type partSink struct {
	n    *node
	to   int // the receiver's TP size
	sink atomic.Pointer[func([]transfer.Piece)]
	buf  []transfer.Piece // the scheduler's goroutine only
}

func (s *partSink) part(p worker.Part) {
	f := s.sink.Load()
	if f == nil {
		return
	}
	var fin transfer.Finished
	switch p.Kind {
	case 'M':
		fin = transfer.Finished{Mamba: true, Layer: p.MambaLayer}
	case '*':
		fin = transfer.Finished{Layer: p.KVLayer, From: p.From, To: p.To, End: p.End}
	default:
		return
	}
	var err error
	s.buf, err = s.n.tranks[p.Rank].Pieces(s.buf[:0], fin, p.Blocks, p.Row, s.to)
	if err != nil {
		// The write after prefill sends what no piece covered.
		s.n.log.Warn("layer-wise part not streamed", "part", p.Part.String(), "err", err)
		return
	}
	(*f)(s.buf)
}
