package kvcache

import "math/bits"

// numClasses is the number of size classes of free extents: class c holds
// extents of length [2^c, 2^(c+1)). MaxBlocks < 2^25, so 25 classes suffice;
// the array is sized for any uint32 length.
const numClasses = 32

const none = -1

// freeIndex is the set of maximal free extents of a pool of n blocks.
//
// Every free extent is indexed by boundary tags (headLen at its first block,
// tailStart at its last) so that a freed run merges with its free
// neighbours in O(1), and it is linked into the list of its size class so
// that allocation finds a fitting extent without scanning the pool. All
// arrays are sized once, at construction: the index never allocates after
// New.
type freeIndex struct {
	n         uint32
	free      int      // free blocks, sum of all extent lengths
	extents   int      // number of free extents
	headLen   []uint32 // headLen[b]: length of the free extent starting at b, 0 if none
	tailStart []uint32 // tailStart[b]: start+1 of the free extent ending at b, 0 if none
	next      []int32  // class-list links, indexed by extent start
	prev      []int32
	classHead [numClasses]int32
	classMask uint32 // bit c set when class c's list is non-empty
}

func newFreeIndex(n uint32) freeIndex {
	f := freeIndex{
		n:         n,
		headLen:   make([]uint32, n),
		tailStart: make([]uint32, n),
		next:      make([]int32, n),
		prev:      make([]int32, n),
	}
	for i := range f.classHead {
		f.classHead[i] = none
	}
	f.insert(0, n)
	return f
}

func class(length uint32) int { return bits.Len32(length) - 1 }

// insert records the free extent [start, start+length). The caller
// guarantees that it does not touch another free extent.
func (f *freeIndex) insert(start, length uint32) {
	f.headLen[start] = length
	f.tailStart[start+length-1] = start + 1
	c := class(length)
	h := f.classHead[c]
	f.next[start] = h
	f.prev[start] = none
	if h != none {
		f.prev[h] = int32(start)
	}
	f.classHead[c] = int32(start)
	f.classMask |= 1 << c
	f.free += int(length)
	f.extents++
}

// remove drops the free extent starting at start and returns its length.
func (f *freeIndex) remove(start uint32) uint32 {
	length := f.headLen[start]
	c := class(length)
	p, nx := f.prev[start], f.next[start]
	if p != none {
		f.next[p] = nx
	} else {
		f.classHead[c] = nx
		if nx == none {
			f.classMask &^= 1 << c
		}
	}
	if nx != none {
		f.prev[nx] = p
	}
	f.headLen[start] = 0
	f.tailStart[start+length-1] = 0
	f.free -= int(length)
	f.extents--
	return length
}

// takeFront takes k blocks from the front of the free extent at start
// (k <= its length) and returns them as a run.
func (f *freeIndex) takeFront(start, k uint32) Run {
	length := f.remove(start)
	if length > k {
		f.insert(start+k, length-k)
	}
	return Run{Start: BlockID(start), Len: k}
}

// release returns run r to the free set, merging it with free neighbours.
func (f *freeIndex) release(r Run) {
	start, end := uint32(r.Start), uint32(r.Start)+r.Len
	if start > 0 && f.tailStart[start-1] != 0 {
		left := f.tailStart[start-1] - 1
		f.remove(left)
		start = left
	}
	if end < f.n && f.headLen[end] != 0 {
		end += f.remove(end)
	}
	f.insert(start, end-start)
}

// fitScan bounds how many extents of the request's own size class fit
// examines before it looks at higher classes, whose every extent fits. It
// keeps allocation O(1) on a pool fragmented into many extents of one
// class, at the cost of sometimes splitting a larger extent than needed.
const fitScan = 8

// fit returns the start of a free extent of at least k blocks, or -1 if no
// extent is long enough. It prefers the smallest size class that can hold
// k (a good fit): up to fitScan extents of k's own class, then the lowest
// non-empty higher class, then the rest of k's class. So it finds a fitting
// extent whenever one exists.
func (f *freeIndex) fit(k uint32) int32 {
	c := class(k)
	// Class c holds lengths [2^c, 2^(c+1)): only some of them fit.
	s := f.classHead[c]
	for i := 0; s != none && i < fitScan; i, s = i+1, f.next[s] {
		if f.headLen[s] >= k {
			return s
		}
	}
	// Every extent of a higher class fits; take the lowest such class.
	if c+1 < numClasses {
		if m := f.classMask >> (c + 1) << (c + 1); m != 0 {
			return f.classHead[bits.TrailingZeros32(m)]
		}
	}
	for ; s != none; s = f.next[s] {
		if f.headLen[s] >= k {
			return s
		}
	}
	return none
}

// largest returns the start of an extent of the highest non-empty size
// class, or -1 when nothing is free.
func (f *freeIndex) largest() int32 {
	if f.classMask == 0 {
		return none
	}
	return f.classHead[bits.Len32(f.classMask)-1]
}
