package reshard

import (
	"fmt"

	"github.com/handoff-io/handoff/kvcache"
)

// Stretch is Len blocks that are consecutive on both sides: the request's
// blocks Src..Src+Len-1 in the source pool hold the same tokens as
// Dst..Dst+Len-1 in the destination pool.
type Stretch struct {
	Src, Dst kvcache.BlockID
	Len      int
}

// Align cuts a request's source runs and destination runs (each in token
// order, as kvcache.Pool.Runs gives them, and covering the same number of
// blocks) into the maximal stretches consecutive on both sides, appended to
// dst in token order. There are at most len(src)+len(dst)-1 of them. A
// pair's KV copies for a stretch are its Copies repeated Len times
// (Copy.Repeat), offset by Src·SrcBytes in the source arena and Dst·DstBytes
// in the destination arena. It panics when the two sides hold different
// numbers of blocks.
func Align(dst []Stretch, src, to []kvcache.Run) []Stretch {
	if a, b := blocks(src), blocks(to); a != b {
		panic(fmt.Sprintf("reshard: Align: source runs hold %d blocks, destination runs %d", a, b))
	}
	var i, j int
	var si, sj uint32 // blocks of src[i] and to[j] already aligned
	for i < len(src) && j < len(to) {
		switch {
		case si == src[i].Len:
			i, si = i+1, 0
		case sj == to[j].Len:
			j, sj = j+1, 0
		default:
			n := min(src[i].Len-si, to[j].Len-sj)
			s := Stretch{Src: src[i].Start + kvcache.BlockID(si), Dst: to[j].Start + kvcache.BlockID(sj), Len: int(n)}
			if k := len(dst) - 1; k >= 0 && dst[k].Src+kvcache.BlockID(dst[k].Len) == s.Src && dst[k].Dst+kvcache.BlockID(dst[k].Len) == s.Dst {
				dst[k].Len += s.Len
			} else {
				dst = append(dst, s)
			}
			si, sj = si+n, sj+n
		}
	}
	return dst
}

func blocks(runs []kvcache.Run) uint64 {
	var n uint64
	for _, r := range runs {
		n += uint64(r.Len)
	}
	return n
}
