package model

import (
	"context"
	"fmt"
	"io"

	"github.com/handoff-io/handoff/kvcache"
)

// Memory is memory an executor's cache lives in when it is not the host
// slice the executor computes over: a device arena read and written
// through the driver (cuda.Arena).
type Memory interface {
	io.ReaderAt
	io.WriterAt
}

// OnDevice runs e over caches that live in device memory: kv and mamba
// hold the pools' arenas (the ones the data plane lands transfers in), and
// the Cache's KVArena and MambaArena, which the caller sizes as for e, are
// host copies e computes over. Around every call the request's own bytes
// (the KV blocks its positions use and its Mamba row) are copied from the
// device into the host copy, and written back after: a copy per step, what
// a CPU reference model can do with device memory. Distinct requests touch
// distinct blocks and rows, so calls on distinct caches may run
// concurrently, as with e itself.
func OnDevice(e Executor, kv, mamba Memory) Executor {
	return &onDevice{e: e, kv: kv, mamba: mamba}
}

type onDevice struct {
	e         Executor
	kv, mamba Memory
}

var _ ContextExecutor = (*onDevice)(nil)

func (d *onDevice) Spec() Spec { return d.e.Spec() }

func (d *onDevice) Prefill(c Cache, tokens []int32) ([]float32, error) {
	return d.PrefillContext(context.Background(), c, tokens)
}

func (d *onDevice) Decode(c Cache, token int32, pos int) ([]float32, error) {
	return d.DecodeContext(context.Background(), c, token, pos)
}

func (d *onDevice) PrefillContext(ctx context.Context, c Cache, tokens []int32) ([]float32, error) {
	return d.step(c, len(tokens), func() ([]float32, error) { return PrefillContext(ctx, d.e, c, tokens) })
}

func (d *onDevice) DecodeContext(ctx context.Context, c Cache, token int32, pos int) ([]float32, error) {
	return d.step(c, pos+1, func() ([]float32, error) { return DecodeContext(ctx, d.e, c, token, pos) })
}

// step loads the cache bytes of a request holding tokens positions, runs
// call, and stores them back if it succeeded.
func (d *onDevice) step(c Cache, tokens int, call func() ([]float32, error)) ([]float32, error) {
	return withDevice(touched(nil, c, tokens, d.kv, d.mamba, ""), call)
}

// withDevice loads xs from device memory into their host copies, runs
// call, and stores them back if it succeeded: a copy per call, what a CPU
// reference model can do with device memory.
func withDevice(xs []touch, call func() ([]float32, error)) ([]float32, error) {
	for _, x := range xs {
		if err := x.copy(true); err != nil {
			return nil, err
		}
	}
	logits, err := call()
	if err != nil {
		return nil, err
	}
	for _, x := range xs {
		if err := x.copy(false); err != nil {
			return nil, err
		}
	}
	return logits, nil
}

// touch is a byte range of one arena that a call reads or writes: in dev,
// the device memory, and in host, the copy the model computes over.
type touch struct {
	what        string // for errors: "kv", "mamba", "shard 1 kv", ...
	dev         Memory
	off, length int64
	host        []byte
}

// copy moves the range from the device memory to the host copy (load) or
// back.
func (x touch) copy(load bool) error {
	if x.off < 0 || x.off+x.length > int64(len(x.host)) {
		return fmt.Errorf("%w: %s bytes [%d, +%d) outside a host copy of %d", ErrInvalidCache, x.what, x.off, x.length, len(x.host))
	}
	b := x.host[x.off : x.off+x.length]
	var err error
	if load {
		_, err = x.dev.ReadAt(b, x.off)
	} else {
		_, err = x.dev.WriteAt(b, x.off)
	}
	if err != nil {
		return fmt.Errorf("model: %s cache in device memory: %w", x.what, err)
	}
	return nil
}

// touched appends to out the bytes a call over c with tokens positions
// reads or writes: the KV blocks of those positions (runs of adjacent
// blocks merged), in kv, and the Mamba row, in mamba; prefix names the
// cache in errors. What lies outside the pools is left out: the executor
// refuses such a cache itself.
func touched(out []touch, c Cache, tokens int, kv, mamba Memory, prefix string) []touch {
	first := len(out)
	if c.KV.Layers > 0 && c.KV.Validate() == nil {
		need := max(0, min(c.KV.BlocksFor(tokens), len(c.Blocks)))
		n := kvcache.BlockID(c.KV.NumBlocks())
		for _, b := range c.Blocks[:need] {
			if b >= n {
				continue
			}
			x := c.KV.BlockExtent(b)
			if k := len(out) - 1; k >= first && out[k].off+out[k].length == x.Offset {
				out[k].length += x.Length
				continue
			}
			out = append(out, touch{prefix + "kv", kv, x.Offset, x.Length, c.KVArena})
		}
	}
	if c.Mamba.Layers > 0 && c.Mamba.Validate() == nil && int64(c.Row) < int64(c.Mamba.TotalRows()) {
		x := c.Mamba.RowExtent(c.Row)
		out = append(out, touch{prefix + "mamba", mamba, x.Offset, x.Length, c.MambaArena})
	}
	return out
}
