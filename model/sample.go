package model

import (
	"math"
	"slices"
)

// Sample picks the next token from logits.
//
// At temperature <= 0 (or NaN) it is greedy: the index of the largest logit,
// the lowest index on ties. Otherwise it draws from softmax(logits/temperature)
// with a uniform number derived only from (seed, step), so the same arguments
// always give the same token. NaN logits are never chosen; a +Inf logit wins
// outright. It returns -1 only for empty logits or logits that are all NaN.
func Sample(logits []float32, temperature float64, seed uint64, step int) int32 {
	best := argmax(logits)
	if best < 0 || !(temperature > 0) {
		return best
	}
	m := float64(logits[best])
	if math.IsInf(m, 0) { // +Inf wins; all -Inf is as good as greedy
		return best
	}
	weight := func(l float32) float64 {
		w := math.Exp((float64(l) - m) / temperature)
		if w != w { // NaN logit, or -Inf at an infinite temperature
			return 0
		}
		return w
	}
	var total float64
	for _, l := range logits {
		total += weight(l)
	}
	// total >= 1 (the max contributes exp(0)); u in [0, 1).
	u := float64(mix64(seed^0x5a3c_e1f0_9d2b_4c67, uint64(step))>>11) * 0x1p-53
	target := u * total
	var acc float64
	last := best
	for i, l := range logits {
		w := weight(l)
		if w == 0 {
			continue
		}
		acc += w
		last = int32(i)
		if acc > target {
			return int32(i)
		}
	}
	return last // rounding left target just above the running sum
}

// SampleTopP is Sample restricted to the nucleus: the most likely tokens
// (at the sampling temperature) whose probabilities add up to at least topP,
// the most likely first and the lower index first on ties; the draw uses the
// same (seed, step) number as Sample. A topP outside (0, 1) (0 meaning unset)
// is plain Sample; a greedy temperature ignores topP.
func SampleTopP(logits []float32, temperature, topP float64, seed uint64, step int) int32 {
	if !(topP > 0 && topP < 1) {
		return Sample(logits, temperature, seed, step)
	}
	best := argmax(logits)
	if best < 0 || !(temperature > 0) {
		return best
	}
	m := float64(logits[best])
	if math.IsInf(m, 0) {
		return best
	}
	weights := make([]float64, len(logits))
	idx := make([]int32, 0, len(logits))
	var total float64
	for i, l := range logits {
		w := math.Exp((float64(l) - m) / temperature)
		if w != w || w == 0 {
			continue
		}
		weights[i] = w
		total += w
		idx = append(idx, int32(i))
	}
	slices.SortStableFunc(idx, func(a, b int32) int {
		switch wa, wb := weights[a], weights[b]; {
		case wa > wb:
			return -1
		case wa < wb:
			return 1
		}
		return 0
	})
	var kept float64
	n := 0
	for n < len(idx) {
		kept += weights[idx[n]]
		n++
		if kept >= topP*total {
			break
		}
	}
	u := float64(mix64(seed^0x5a3c_e1f0_9d2b_4c67, uint64(step))>>11) * 0x1p-53
	target := u * kept
	var acc float64
	for _, i := range idx[:n] {
		acc += weights[i]
		if acc > target {
			return i
		}
	}
	return idx[n-1]
}

// argmax returns the index of the largest non-NaN value, lowest on ties; -1
// when there is none.
func argmax(x []float32) int32 {
	best := int32(-1)
	var bv float32
	for i, v := range x {
		if v != v {
			continue
		}
		if best < 0 || v > bv {
			best, bv = int32(i), v
		}
	}
	return best
}
