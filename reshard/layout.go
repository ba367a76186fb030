package reshard

import (
	"fmt"
	"math"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// MaxTP bounds a tensor-parallel size. A Plan holds From*To copy lists.
const MaxTP = 1 << 10

// maxDim bounds Rows, Items and ItemBytes so that products of two of them
// cannot overflow before the checked size arithmetic sees them.
const maxDim = 1 << 30

// Section is one stretch of every row of a unit: Items items of ItemBytes
// bytes each, items in order. A shard holds a contiguous range of the items
// (see Layout.Holds), packed from the section's start.
type Section struct {
	Name      string // what the section holds: "x", "B", "ssm", ...
	Dim       string // the dimension it is split along, for errors: "kv heads", "mamba heads", "groups"
	Items     int    // items of the whole model (TP 1)
	ItemBytes int64  // bytes of one item in one row
	Replicate bool   // a TP size above Items is allowed: each shard holds one item, replicated
}

// Layout is the byte layout of one unit of a cache (one KV block, one
// Mamba state row): Rows rows, each the concatenation of Sections. On a
// shard of a TP-T group every row holds, of each section, the items the
// shard owns, packed, so a shard's row is Σ local(s, T)·ItemBytes bytes and
// its unit Rows times that. Units are stored back to back in a pool's arena,
// so a run of n consecutive units is n·Rows rows at the same stride.
type Layout struct {
	Name     string // "kv" or "mamba", for errors
	Rows     int
	Sections []Section
}

// KV returns the layout of one block of a KV pool whose Config describes
// the whole model (TP 1): 2·Layers rows (layer 0 K, layer 0 V, layer 1 K,
// ...), each the layer's heads [KVHeads][TokensPerBlock][HeadDim], so an
// item is one head's TokensPerBlock slots. Only Layers, KVHeads, HeadDim,
// ElemSize and TokensPerBlock are read.
func KV(c kvcache.Config) Layout {
	return Layout{
		Name: "kv",
		Rows: 2 * c.Layers,
		Sections: []Section{
			{Name: "kv", Dim: "kv heads", Items: c.KVHeads, ItemBytes: int64(c.TokensPerBlock) * int64(c.HeadDim) * int64(c.ElemSize), Replicate: true},
		},
	}
}

// Mamba returns the layout of one state row of a Mamba pool whose Config
// describes the whole model (TP 1): one row per layer, each the three conv
// sections in ConvLayout order, then the SSM state. The x (Mamba2) and V
// (GDN) sections and the SSM state are split by heads, a head being HeadDim
// conv channels or [HeadDim][DState] SSM elements; B and C (Q and K) by
// groups of DState channels. A conv channel is DConv-1 elements. Only the
// dimensions, element sizes and ConvLayout are read.
func Mamba(c mambacache.Config) Layout {
	col := int64(c.DConv-1) * int64(c.ConvElemSize)
	heads := func(name string) Section {
		return Section{Name: name, Dim: "mamba heads", Items: c.Heads, ItemBytes: int64(c.HeadDim) * col}
	}
	groups := func(name string) Section {
		return Section{Name: name, Dim: "groups", Items: c.NGroups, ItemBytes: int64(c.DState) * col, Replicate: true}
	}
	ssm := Section{Name: "ssm", Dim: "mamba heads", Items: c.Heads,
		ItemBytes: int64(c.HeadDim) * int64(c.DState) * int64(c.SSMElemSize)}
	conv := []Section{heads("x"), groups("B"), groups("C")}
	if c.ConvLayout == mambacache.ConvQKV {
		conv = []Section{groups("Q"), groups("K"), heads("V")}
	}
	return Layout{Name: "mamba", Rows: c.Layers, Sections: append(conv, ssm)}
}

// MambaSD is Mamba for a pool that keeps each layer's conv state position
// by position, [DConv-1][conv channels] with the channels innermost
// (vLLM's "SD" layout, its default), rather than channel by channel: the
// conv sections repeat once per position, an item being one element of
// each of its channels. The SSM state is as in Mamba. A shard of it holds
// what a shard of Mamba(c) holds, transposed.
func MambaSD(c mambacache.Config) Layout {
	l := Mamba(c)
	conv, ssm := l.Sections[:len(l.Sections)-1], l.Sections[len(l.Sections)-1]
	pos := int64(c.DConv - 1)
	secs := make([]Section, 0, int(pos)*len(conv)+1)
	for range pos {
		for _, s := range conv {
			s.ItemBytes /= pos
			secs = append(secs, s)
		}
	}
	l.Sections = append(secs, ssm)
	return l
}

// KVShard returns the Config of a KV pool on one shard of a TP-tp group:
// c with KVHeads = KVHeads/tp, or 1 (a replicated head) when tp > KVHeads.
// Its block layout is the shard layout the plans of KV(c) use.
func KVShard(c kvcache.Config, tp int) (kvcache.Config, error) {
	if err := KV(c).Check(tp); err != nil {
		return kvcache.Config{}, err
	}
	c.KVHeads = local(c.KVHeads, tp)
	return c, nil
}

// MambaShard returns the Config of a Mamba pool on one shard of a TP-tp
// group: c with Heads = Heads/tp and NGroups = NGroups/tp, or 1 (a
// replicated group) when tp > NGroups. Its row layout is the shard layout
// the plans of Mamba(c) use.
func MambaShard(c mambacache.Config, tp int) (mambacache.Config, error) {
	if err := Mamba(c).Check(tp); err != nil {
		return mambacache.Config{}, err
	}
	c.Heads, c.NGroups = local(c.Heads, tp), local(c.NGroups, tp)
	return c, nil
}

// Check reports whether l is a valid layout that splits over tp shards. The
// error wraps ErrInvalidShape, ErrInvalidTP or ErrIndivisible and names the
// section and dimension.
func (l Layout) Check(tp int) error {
	if err := l.valid(); err != nil {
		return err
	}
	if tp < 1 || tp > MaxTP {
		return fmt.Errorf("%w: TP %d, want 1..%d", ErrInvalidTP, tp, MaxTP)
	}
	for _, s := range l.Sections {
		if s.Items%tp == 0 || (s.Replicate && tp%s.Items == 0) {
			continue
		}
		want := "TP must divide them"
		if s.Replicate {
			want = "TP must divide them or be a multiple of them"
		}
		return fmt.Errorf("%w: %s section %s: %d %s over TP %d (%s)", ErrIndivisible, l.Name, s.Name, s.Items, s.Dim, tp, want)
	}
	return nil
}

// valid checks the dimensions and that a TP-1 unit's size fits in int64
// (a shard's unit is never larger).
func (l Layout) valid() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s: "+format, append([]any{ErrInvalidShape, l.Name}, args...)...)
	}
	if l.Rows < 1 || l.Rows > maxDim {
		return bad("%d rows, want 1..%d", l.Rows, maxDim)
	}
	if len(l.Sections) == 0 {
		return bad("no sections")
	}
	var row int64
	for _, s := range l.Sections {
		if s.Items < 1 || s.Items > maxDim || s.ItemBytes < 1 || s.ItemBytes > maxDim {
			return bad("section %s of %d %s of %d bytes, want 1..%d of each", s.Name, s.Items, s.Dim, s.ItemBytes, maxDim)
		}
		b := int64(s.Items) * s.ItemBytes
		if row > math.MaxInt64-b {
			return bad("row size overflows int64")
		}
		row += b
	}
	if row > math.MaxInt64/int64(l.Rows) {
		return bad("unit size overflows int64")
	}
	return nil
}

// RowBytes is the size of one row on a shard of a TP-tp group. Meaningful
// only when Check(tp) passes.
func (l Layout) RowBytes(tp int) int64 {
	var n int64
	for _, s := range l.Sections {
		n += int64(local(s.Items, tp)) * s.ItemBytes
	}
	return n
}

// UnitBytes is the size of one unit (block, row) on a shard of a TP-tp
// group: Rows·RowBytes(tp). It equals kvcache's BlockBytes of KVShard and
// mambacache's RowBytes of MambaShard.
func (l Layout) UnitBytes(tp int) int64 { return int64(l.Rows) * l.RowBytes(tp) }

// Holds returns the items [lo, hi) of section s that shard r of a TP-tp
// group holds: [r·n/tp, (r+1)·n/tp) when tp divides n, else the one
// replicated item r·n/tp (tp a multiple of n).
func Holds(s Section, tp, r int) (lo, hi int) { return holds(s.Items, tp, r) }

func holds(n, tp, r int) (lo, hi int) {
	if tp <= n {
		return r * n / tp, (r + 1) * n / tp
	}
	lo = r * n / tp
	return lo, lo + 1
}

// local is the number of items a shard of a TP-tp group holds.
func local(n, tp int) int {
	if tp <= n {
		return n / tp
	}
	return 1
}

// writes returns the items [lo, hi) of an n-item section that source shard
// rs of a TP-tp group writes into destination shard rd (if rd holds them):
// every item it holds when tp divides n. When items are replicated (tp a
// multiple of n), item i has the tp/n replicas i·tp/n + k, and destination
// shard rd takes it from replica k = rd mod tp/n: one writer per item and
// destination shard, spread over the replicas, and for equal sizes each
// shard's own mirror.
func writes(n, tp, rs, rd int) (lo, hi int) {
	if tp <= n {
		return holds(n, tp, rs)
	}
	rep := tp / n
	if rs%rep != rd%rep {
		return 0, 0
	}
	return rs / rep, rs/rep + 1
}
