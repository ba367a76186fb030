package rdma

import "github.com/handoff-io/handoff/internal/crc32c"

// crcFor is the crc that p's bytes extend: the manifest's for its extent,
// or the piece's own when it is summed apart (a striped extent, a stream).
func (op *writeOp) crcFor(p *piece) *uint32 {
	if p.apart {
		return &p.crc
	}
	return &op.manifest.CRC[p.ext]
}

// copySum copies src into dst (same length, no overlap) and folds the bytes,
// the next of piece p, into its crc (crcFor) in the same pass: they are
// summed from the registers that carry them to dst.
func (op *writeOp) copySum(p *piece, dst, src []byte) {
	if op.noCRC {
		copy(dst, src)
		return
	}
	sum := op.crcFor(p)
	*sum = crc32c.CopyUpdate(*sum, dst, src)
}
