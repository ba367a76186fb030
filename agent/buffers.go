package agent

import (
	"fmt"
	"math"
	"slices"
)

// The memory a registration passes, as buffers: the KV pool's and the
// Mamba pool's (registration by pool), or Request.Buffers, which the
// layout's planes name. Each buffer is one region; which of them are one
// memory (a file, an allocation) decides which planes must not overlap.

// maxBuffers bounds the buffers of a registration: as many as one message
// passes descriptors (maxQueuedFDs), enough for a tensor per attention
// layer and two per Mamba layer of today's models, each an allocation of
// its own.
const maxBuffers = maxQueuedFDs

// bufferMem is one buffer as registered: its name (for errors), size, and
// which memory it is: buffers with one key (a file's, an allocation's)
// are one memory, each from its base in it.
type bufferMem struct {
	name  string
	bytes int64
	key   string // "": a memory of its own
	base  uint64
	fd    int // the descriptor it was passed as (host memory, a VMM allocation), else -1
}

// hostFiles lists the files of the buffers in host memory, each once: the
// memory a shm writer maps and copies into (device memory is copied by the
// agent that maps it, which fences that copy itself).
func hostFiles(bufs []Buffer, mems []bufferMem) []string {
	var files []string
	for i, b := range bufs {
		if b.Bytes > 0 && b.CUDA == nil && mems[i].key != "" && !slices.Contains(files, mems[i].key) {
			files = append(files, mems[i].key)
		}
	}
	return files
}

// checkBuffers compares what the placements need of each buffer with what
// was registered: at least as much (exactly as much for a pool without
// planes: registered by its size), and every buffer needed. Planes that
// share a byte of one memory (two buffers of one file or allocation, or
// one passed for both caches) are refused: a write into one would land in
// the other, a reserved row included.
func checkBuffers(kv, mamba placement, bufs []bufferMem) error {
	used := make([]bool, len(bufs))
	for _, m := range []placement{kv, mamba} {
		for b, need := range m.need {
			if need == 0 {
				continue
			}
			if b >= len(bufs) {
				return fmt.Errorf("%w: the layout places planes in buffer %d, which was not registered", ErrInvalidLayout, b)
			}
			if bufs[b].bytes <= 0 {
				return fmt.Errorf("%w: the layout places a cache in the %s, which was not registered", ErrInvalidLayout, bufs[b].name)
			}
			got := uint64(bufs[b].bytes)
			if got < need || (!m.placed() && got != need) {
				return fmt.Errorf("%w: %s of %d bytes, the layout needs %d", ErrInvalidLayout, bufs[b].name, got, need)
			}
			used[b] = true
		}
	}
	for b, u := range used {
		if !u && bufs[b].bytes != 0 {
			return fmt.Errorf("%w: %s of %d bytes registered, but the layout places nothing in it", ErrInvalidLayout, bufs[b].name, bufs[b].bytes)
		}
	}
	type labelled struct {
		p    part
		name string
		i    int
	}
	var all []labelled
	for i, p := range kv.parts {
		all = append(all, labelled{p, "kv", i})
	}
	for i, p := range mamba.parts {
		all = append(all, labelled{p, "mamba", i})
	}
	for i, a := range all {
		for _, b := range all[i+1:] {
			ka, kb := bufs[a.p.buf], bufs[b.p.buf]
			if a.p.buf != b.p.buf && (ka.key == "" || ka.key != kb.key) {
				continue // different memory
			}
			if a.p.buf == b.p.buf && a.name == b.name {
				continue // checked with its placement
			}
			pa, pb := a.p, b.p
			pa.off, pa.end = pa.off+ka.base, pa.end+ka.base
			pb.off, pb.end = pb.off+kb.base, pb.end+kb.base
			if c := clash(pa, pb); c != "" {
				return fmt.Errorf("%w: %s plane %d (%s) and %s plane %d (%s) overlap in one memory: they %s", ErrInvalidLayout, a.name, a.i, ka.name, b.name, b.i, kb.name, c)
			}
		}
	}
	return nil
}

// describeBuffers names the registered buffers and says which are one
// memory: host buffers by their file (one memfd passed twice), device
// buffers by their allocation's handle or, for a VMM allocation, by the
// id the engine gave it, from their offset in it.
func describeBuffers(bufs []Buffer, fds []int, buffered bool) ([]bufferMem, error) {
	out := make([]bufferMem, len(bufs))
	next := 0
	for i, b := range bufs {
		m := &out[i]
		m.name, m.bytes, m.fd = fmt.Sprintf("buffer %d", i), b.Bytes, -1
		if !buffered {
			m.name = []string{"kv pool", "mamba pool"}[i]
		}
		switch {
		case b.Bytes < 0:
			return nil, fmt.Errorf("%w: %s of %d bytes", ErrInvalidLayout, m.name, b.Bytes)
		case b.Bytes == 0:
		case b.CUDA != nil:
			dm := b.CUDA
			switch {
			case dm.Offset > math.MaxInt64:
				return nil, fmt.Errorf("%w: %s at offset %d", ErrInvalidLayout, m.name, dm.Offset)
			case dm.VMMBytes > 0 && len(dm.Handle) > 0:
				return nil, fmt.Errorf("%w: %s names both a CUDA IPC handle and a VMM allocation", ErrInvalidLayout, m.name)
			case dm.VMMBytes > 0:
				m.fd = fds[next]
				next++
				if dm.VMMID != 0 {
					m.key = fmt.Sprintf("cuda vmm %d", dm.VMMID)
				}
			default:
				m.key = "cuda " + dm.Device + " " + string(dm.Handle)
			}
			m.base = dm.Offset
		default:
			m.fd = fds[next]
			next++
			m.key = fileKey(m.fd)
		}
	}
	return out, nil
}
