package crc32c

import (
	"hash/crc32"

	"golang.org/x/sys/cpu"
)

// The folding kernels: eight 512-bit lanes (AVX-512) or eight 256-bit lanes
// (AVX2 with VEX-encoded VPCLMULQDQ: Zen 3, Ice Lake and later).
var (
	have512  = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VL && cpu.X86.HasAVX512VPCLMULQDQ && cpu.X86.HasSSE42
	have256  = cpu.X86.HasAVX2 && cpu.X86.HasSSE42 && hasVPCLMULQDQ()
	haveFold = have512 || have256

	keys512 = foldKeyTable(64)
	keys256 = foldKeyTable(32)
)

// hasVPCLMULQDQ reports CPUID.(EAX=7,ECX=0):ECX[10], which x/sys/cpu only
// reads on AVX-512 cores; with AVX2 it means the 256-bit form.
func hasVPCLMULQDQ() bool {
	if max, _, _, _ := cpuid(0, 0); max < 7 {
		return false
	}
	_, _, ecx, _ := cpuid(7, 0)
	return ecx&(1<<10) != 0
}

func cpuid(leaf, sub uint32) (eax, ebx, ecx, edx uint32)

// fold512 returns the CRC (no inversions: the raw register, from state)
// of p's first n bytes, the largest multiple of 512 it holds. len(p) must
// be at least 512.
//
//go:noescape
func fold512(state uint32, p []byte, keys *[8][2]uint64) (raw uint32, n int)

// copyFold512 is fold512 over src that also copies the blocks it sums into
// dst. len(dst) >= len(src) >= 512.
//
//go:noescape
func copyFold512(state uint32, dst, src []byte, keys *[8][2]uint64) (raw uint32, n int)

// fold256 and copyFold256 are fold512 and copyFold512 in 256-byte steps.
//
//go:noescape
func fold256(state uint32, p []byte, keys *[8][2]uint64) (raw uint32, n int)

//go:noescape
func copyFold256(state uint32, dst, src []byte, keys *[8][2]uint64) (raw uint32, n int)

// updateFold and copyUpdateFold take inputs of at least foldBytes; shorter
// ones go to hash/crc32.
func updateFold(crc uint32, p []byte) uint32 {
	if len(p) < foldBytes {
		return crc32.Update(crc, table, p)
	}
	var raw uint32
	var n int
	if have512 {
		raw, n = fold512(^crc, p, &keys512)
	} else {
		raw, n = fold256(^crc, p, &keys256)
	}
	return crc32.Update(^raw, table, p[n:])
}

func copyUpdateFold(crc uint32, dst, src []byte) uint32 {
	if len(src) < foldBytes {
		copy(dst, src)
		return crc32.Update(crc, table, src)
	}
	var raw uint32
	var n int
	if have512 {
		raw, n = copyFold512(^crc, dst, src, &keys512)
	} else {
		raw, n = copyFold256(^crc, dst, src, &keys256)
	}
	copy(dst[n:], src[n:])
	return crc32.Update(^raw, table, src[n:])
}

// Kernel names the implementation long inputs use on this core.
func Kernel() string {
	switch {
	case have512:
		return "avx512-vpclmulqdq"
	case have256:
		return "avx2-vpclmulqdq"
	}
	return "hash/crc32 (sse4.2)"
}
