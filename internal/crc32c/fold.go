package crc32c

import "math/bits"

// Folding, for a reflected CRC: the crc contribution of a 16-byte block B
// followed by n bytes, B·x^(8n) mod P, is also that of the block
// lo(B)·K1 ⊕ hi(B)·K2 placed d bytes further on, with K1 = x^(8d+32) mod P
// and K2 = x^(8d-32) mod P, bit-reflected and shifted left by one (the
// carry-less product of two reflected 64-bit values is the reflected
// 127-bit product). Eight lanes (512- or 256-bit) fold eight lanes' bytes
// at a time, then into the last lane; the CRC32 instruction sums that
// lane's bytes and hash/crc32 the tail.

// foldKeyTable returns the keys of eight lanes of laneBytes each: [0] folds
// a lane by all eight lanes' bytes, [i] for i in 1..7 folds lane i-1 onto
// the last one, (8-i)·laneBytes on.
func foldKeyTable(laneBytes int) [8][2]uint64 {
	var t [8][2]uint64
	t[0] = foldKeys(8 * laneBytes)
	for i := 1; i < 8; i++ {
		t[i] = foldKeys((8 - i) * laneBytes)
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
