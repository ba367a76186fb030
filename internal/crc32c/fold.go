package crc32c

import "math/bits"

// Folding, for a reflected CRC: the crc contribution of a 16-byte block B
// followed by n bytes, B·x^(8n) mod P, is also that of the block
// lo(B)·K1 ⊕ hi(B)·K2 placed d bytes further on, with K1 = x^(8d+32) mod P
// and K2 = x^(8d-32) mod P, bit-reflected and shifted left by one (the
// carry-less product of two reflected 64-bit values is the reflected
// 127-bit product). Eight 512-bit lanes fold foldBytes at a time, then
// into the last lane; the CRC32 instruction sums that lane's 64 bytes and
// hash/crc32 the tail shorter than foldBytes.

// foldKeyTable returns the keys the assembly uses: [0] folds a lane by
// foldBytes, [i] for i in 1..7 folds lane i-1 (of eight, 64 bytes each) onto
// the last one, (8-i)·64 bytes on.
func foldKeyTable() [8][2]uint64 {
	var t [8][2]uint64
	t[0] = foldKeys(foldBytes)
	for i := 1; i < 8; i++ {
		t[i] = foldKeys((8 - i) * 64)
	}
	return t
}

// foldKeys returns [K1, K2] for a fold distance of d bytes.
func foldKeys(d int) [2]uint64 {
	return [2]uint64{reflectedXPow(8*d + 32), reflectedXPow(8*d - 32)}
}

// reflectedXPow returns x^n mod P, bit-reflected, shifted left by one.
func reflectedXPow(n int) uint64 {
	const poly = 0x1EDC6F41 // Castagnoli, x^32 implied
	r := uint32(1)
	for range n {
		carry := r >> 31
		r <<= 1
		if carry == 1 {
			r ^= poly
		}
	}
	return uint64(bits.Reverse32(r)) << 1
}
