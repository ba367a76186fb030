package crc32c

// Combine returns the CRC-32C of a message A followed by B, given crcA of A,
// crcB of B and lenB, B's length in bytes: what Update(crcA, B) returns,
// without B. Pieces of one buffer summed apart (on several connections, or
// cores) are joined with it in order. It costs O(log lenB) carry-less
// multiplications of 32-bit values.
//
// Why it works: Update is affine in its input crc, and appending B moves
// A's contribution by x^(8·lenB) modulo P; the inversions at both ends of
// each crc cancel in the XOR (as in zlib's crc32_combine).
func Combine(crcA, crcB uint32, lenB int64) uint32 {
	if lenB <= 0 {
		return crcA ^ crcB ^ Checksum(nil)
	}
	return mulMod(xPow8n(uint64(lenB)), crcA) ^ crcB
}

// reflectedPoly is P = Castagnoli's polynomial, bit-reflected (x^0 in the
// top bit), without its x^32 term.
const reflectedPoly = 0x82F63B78

// mulMod returns a·b mod P for bit-reflected a and b (x^0 is bit 31).
func mulMod(a, b uint32) uint32 {
	var p uint32
	for m := uint32(1) << 31; m != 0; m >>= 1 {
		if a&m != 0 {
			p ^= b
		}
		// b = b·x mod P: in reflected form a right shift, reduced by P when
		// x^31 falls off the end.
		if b&1 != 0 {
			b = b>>1 ^ reflectedPoly
		} else {
			b >>= 1
		}
	}
	return p
}

// x2k[k] is x^(2^k) mod P, reflected; x2k[0] = x. 3+64 entries cover 8n
// for every uint64 n.
var x2k = func() (t [67]uint32) {
	t[0] = 1 << 30
	for k := 1; k < len(t); k++ {
		t[k] = mulMod(t[k-1], t[k-1])
	}
	return t
}()

// xPow8n returns x^(8n) mod P, reflected, by squaring: 8n = n·2^3.
func xPow8n(n uint64) uint32 {
	p := uint32(1) << 31 // x^0
	for k := 3; n != 0; n, k = n>>1, k+1 {
		if n&1 != 0 {
			p = mulMod(x2k[k], p)
		}
	}
	return p
}
