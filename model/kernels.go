package model

import (
	"encoding/binary"
	"math"
)

// The kernels round every product explicitly (float32(a*b)) so the compiler
// never fuses a multiply-add: results are the same on every architecture and
// in every binary, which the prefill == decode and remote == local guarantees
// rely on.

// dot sums a[i]*b[i] in four interleaved partial sums (for instruction-level
// parallelism), combined in a fixed order.
func dot(a, b []float32) float32 {
	b = b[:len(a)]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(a); i += 4 {
		s0 += float32(a[i] * b[i])
		s1 += float32(a[i+1] * b[i+1])
		s2 += float32(a[i+2] * b[i+2])
		s3 += float32(a[i+3] * b[i+3])
	}
	for ; i < len(a); i++ {
		s0 += float32(a[i] * b[i])
	}
	return (s0 + s1) + (s2 + s3)
}

// matVec sets out[r] = w[r*cols:(r+1)*cols] . x for every row r of out.
func matVec(out, w, x []float32) {
	cols := len(x)
	for r := range out {
		out[r] = dot(w[r*cols:(r+1)*cols], x)
	}
}

func rmsNorm(out, x, w []float32) {
	var ss float32
	for _, v := range x {
		ss += float32(v * v)
	}
	inv := float32(1 / math.Sqrt(float64(ss)/float64(len(x))+1e-6))
	for i, v := range x {
		out[i] = float32(float32(v*inv) * w[i])
	}
}

func silu(x float32) float32 {
	return float32(float64(x) / (1 + float64(exp32(-x))))
}

func softplus(x float32) float32 {
	if x > 20 {
		return x
	}
	return float32(math.Log1p(float64(exp32(x))))
}

// exp32 is e^x to float32 precision, computed the same way on every machine
// (math.Exp picks an FMA path by CPU feature): x = k*ln2 + r with |r| <= ln2/2,
// then a degree-7 Taylor polynomial of e^r scaled by 2^k.
func exp32(x float32) float32 {
	switch {
	case x != x:
		return x
	case x < -104:
		return 0
	case x > 89:
		return float32(math.Inf(1))
	}
	xd := float64(x)
	k := math.Floor(float64(xd*math.Log2E) + 0.5)
	r := xd - float64(k*math.Ln2)
	p := 1.0 / 5040
	p = float64(p*r) + 1.0/720
	p = float64(p*r) + 1.0/120
	p = float64(p*r) + 1.0/24
	p = float64(p*r) + 1.0/6
	p = float64(p*r) + 0.5
	p = float64(p*r) + 1
	p = float64(p*r) + 1
	// 2^k as float64 bits; k is in [-151, 129], inside float64's normal range.
	return float32(p * math.Float64frombits(uint64(int64(k)+1023)<<52))
}

func addTo(dst, src []float32) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] += src[i]
	}
}

// f32At reads the little-endian float32 at element i of b.
func f32At(b []byte, i int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
}

func putF32(b []byte, i int, v float32) {
	binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
}

// loadF32s decodes len(dst) little-endian float32 values from p.
func loadF32s(dst []float32, p []byte) {
	p = p[:4*len(dst)]
	for i := range dst {
		dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(p[4*i:]))
	}
}

// axpy adds w * x to out.
func axpy(out []float32, w float32, x []float32) {
	x = x[:len(out)]
	for i := range out {
		out[i] += float32(w * x[i])
	}
}

func putF32s(p []byte, v []float32) {
	p = p[:4*len(v)]
	for i, x := range v {
		binary.LittleEndian.PutUint32(p[4*i:], math.Float32bits(x))
	}
}

// softmax turns attention scores into weights in place, in one fixed order
// (max, exponentials and their sum, then one scaling), so that every
// tensor-parallel split computes the same bits.
func softmax(scores []float32) {
	mx := float32(math.Inf(-1))
	for _, sc := range scores {
		mx = max(mx, sc)
	}
	var sum float32
	for t, sc := range scores {
		e := exp32(sc - mx)
		scores[t] = e
		sum += e
	}
	inv := 1 / sum
	for t := range scores {
		scores[t] = float32(scores[t] * inv)
	}
}
