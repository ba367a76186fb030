package rdma

import "github.com/handoff-io/handoff/internal/crc32c"

// copySum copies src into dst (same length, no overlap) and folds the bytes,
// the next of destination extent ext, into the manifest's crc in the same
// pass: they are summed from the registers that carry them to dst.
func (op *writeOp) copySum(ext uint32, dst, src []byte) {
	if op.noCRC {
		copy(dst, src)
		return
	}
	op.manifest.CRC[ext] = crc32c.CopyUpdate(op.manifest.CRC[ext], dst, src)
}
