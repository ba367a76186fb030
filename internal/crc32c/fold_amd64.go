package crc32c

import (
	"hash/crc32"

	"golang.org/x/sys/cpu"
)

var haveFold = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VL && cpu.X86.HasAVX512VPCLMULQDQ && cpu.X86.HasSSE42

var keys = foldKeyTable()

// fold512 returns the CRC (no inversions: the raw register, from state)
// of p's first n bytes, the largest multiple of foldBytes it holds. len(p)
// must be at least foldBytes.
//
//go:noescape
func fold512(state uint32, p []byte, keys *[8][2]uint64) (raw uint32, n int)

// copyFold512 is fold512 over src that also copies the blocks it sums into
// dst. len(dst) >= len(src) >= foldBytes.
//
//go:noescape
func copyFold512(state uint32, dst, src []byte, keys *[8][2]uint64) (raw uint32, n int)

func copyUpdateFold(crc uint32, dst, src []byte) uint32 {
	raw, n := copyFold512(^crc, dst, src, &keys)
	copy(dst[n:], src[n:])
	return crc32.Update(^raw, table, src[n:])
}

func updateFold(crc uint32, p []byte) uint32 {
	raw, n := fold512(^crc, p, &keys)
	return crc32.Update(^raw, table, p[n:])
}
