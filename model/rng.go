package model

// splitmix64 is the generator behind every deterministic number in this
// package: weights, state patterns and sampling draws.
type splitmix64 uint64

func (s *splitmix64) next() uint64 {
	*s += 0x9e3779b97f4a7c15
	return finalize(uint64(*s))
}

// uniform returns a float in [-a, a).
func (s *splitmix64) uniform(a float64) float32 {
	u := float64(s.next()>>11) * 0x1p-53
	return float32((2*u - 1) * a)
}

func finalize(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// mix64 hashes two words into one; it is not commutative.
func mix64(a, b uint64) uint64 {
	return finalize(finalize(a+0x9e3779b97f4a7c15) ^ (b + 0x6a09e667f3bcc909))
}
