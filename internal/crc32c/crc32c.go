// Package crc32c computes CRC-32C (Castagnoli), the checksum in the data
// path's commit manifests, with the result hash/crc32 gives for the
// Castagnoli table. On x86-64 cores with vector carry-less multiply
// (VPCLMULQDQ: AVX-512, or AVX2 on Zen 3 and Ice Lake onwards) long inputs
// are folded in eight independent lanes, about twice as fast as the SSE 4.2
// CRC32 instruction that hash/crc32 uses in cache and nearly three times
// from memory; elsewhere, and for short inputs, it is hash/crc32.
package crc32c

import "hash/crc32"

var table = crc32.MakeTable(crc32.Castagnoli)

// Update returns the CRC-32C of crc's message followed by p, as
// crc32.Update(crc, crc32.MakeTable(crc32.Castagnoli), p) does.
func Update(crc uint32, p []byte) uint32 {
	if len(p) >= foldMin && haveFold {
		return updateFold(crc, p)
	}
	return crc32.Update(crc, table, p)
}

// CopyUpdate copies src into dst, which must be at least as long and must
// not overlap it, and returns Update(crc, src). With folding the bytes are summed from the
// registers that copy them, in one pass over memory: about the cost of the
// copy alone, where a copy and then a sum of the destination costs half
// as much again.
func CopyUpdate(crc uint32, dst, src []byte) uint32 {
	if len(dst) < len(src) {
		panic("crc32c: CopyUpdate destination shorter than source")
	}
	if len(src) >= fuseMin && haveFold {
		return copyUpdateFold(crc, dst, src)
	}
	copy(dst, src)
	return Update(crc, dst[:len(src)])
}

// Checksum returns the CRC-32C of p.
func Checksum(p []byte) uint32 { return Update(0, p) }

// foldBytes is the span of the widest folding lanes: eight 512-bit
// registers.
const foldBytes = 512

// fuseMin is the shortest copy worth summing in the same pass: below it a
// copy and then a sum of the destination, still in L1, measured faster.
const fuseMin = 8 << 10

// foldMin is the shortest input worth folding: below it the lanes' load
// and reduction cost more than they save.
const foldMin = 2 * foldBytes
