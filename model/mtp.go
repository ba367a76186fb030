package model

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"strings"

	"github.com/handoff-io/handoff/kvcache"
)

// DraftLayer is the layer-pattern byte of a draft (MTP) layer: an attention
// layer whose K and V live in the KV pool like the target's (the last KV
// layer), written by every prefill and decode step, and read only by
// Draft. It adds nothing to the target's hidden state, so a model's
// tokens are the same with and without it; it changes the KV layout and so
// the Fingerprint, which is what keeps a peer without it from exchanging
// caches with one that has it.
//
// The layer is multi-token prediction as DeepSeek-V3 and Nemotron-H's MTP
// modules do it: its entry at position p is computed from the token at p
// and the target's context at p-1 (here the V of the target's last
// attention layer, read from the pool), attends over the entries before
// it, and its output predicts the token at p+1, the one after the token
// the target is about to process. Draft chains it: each draft's own entry
// and V are the next one's input.
const DraftLayer = '+'

// ErrNoDraftHead is returned by Draft for a model without a draft layer.
var ErrNoDraftHead = errors.New("model: no draft head")

// HasDraftHead reports whether e's model has a draft layer (a model looked
// up with "?mtp=1").
func HasDraftHead(e Executor) bool {
	return strings.IndexByte(e.Spec().LayerPattern, DraftLayer) >= 0
}

// withDraftLayer returns spec with a draft layer after its layers: one
// more attention layer in the KV pool.
func withDraftLayer(spec Spec) Spec {
	spec.LayerPattern += string(rune(DraftLayer))
	spec.KV.Layers++
	return spec
}

// drafter is implemented by executors with a draft head, over one cache or
// a TP group's shard caches.
type drafter interface {
	draftShards(cs []Cache, token int32, pos, k int, dst []int32) ([]int32, error)
}

// Draft appends to dst up to k draft tokens for the positions after pos,
// where token is the next token the target will process (at pos): greedy
// picks of e's draft head, run on the request's cache c, which must hold
// positions [0, pos). Draft only reads the cache: the draft layer's
// entries for the drafts live in a scratch of the call, and the target's
// own step writes the entry of each position it processes. Drafts stop
// where their verification would pass the model's context. The error wraps ErrNoDraftHead for a model without
// a draft layer, or the package's sentinels for a bad argument.
func Draft(ctx context.Context, e Executor, c Cache, token int32, pos, k int, dst []int32) ([]int32, error) {
	if err := ctx.Err(); err != nil {
		return dst, fmt.Errorf("model: draft: %w", err)
	}
	spec := e.Spec()
	if !HasDraftHead(e) {
		return dst, fmt.Errorf("%w: %s (look it up with ?mtp=1)", ErrNoDraftHead, spec.Name)
	}
	if err := checkToken(&spec, token); err != nil {
		return dst, err
	}
	if err := checkPos(&spec, pos); err != nil {
		return dst, err
	}
	if pos < 1 || k < 0 {
		return dst, fmt.Errorf("%w: draft %d tokens after position %d", ErrInvalidCache, k, pos)
	}
	k = min(k, spec.MaxContext-1-pos) // a verification runs positions pos .. pos+k
	if k <= 0 {
		return dst, nil
	}
	cs := []Cache{c}
	inner := unwrap(e)
	if _, ok := inner.(*onDevice); ok {
		return dst, fmt.Errorf("%w: a draft head over device memory (it reads the pool's host bytes)", ErrInvalidOption)
	}
	if s, ok := inner.(*sharded); ok {
		if s.device() {
			return dst, fmt.Errorf("%w: a draft head over device memory", ErrInvalidOption)
		}
		cs, inner = s.caches(c), unwrap(s.inner)
	}
	d, ok := inner.(drafter)
	if !ok {
		return dst, fmt.Errorf("%w: %s", ErrNoDraftHead, spec.Name)
	}
	shard, err := ShardSpec(spec, len(cs))
	if err != nil {
		return dst, err
	}
	for r := range cs {
		if err := checkKV(&shard, &cs[r], pos); err != nil {
			return dst, fmt.Errorf("shard %d: %w", r, err)
		}
	}
	return d.draftShards(cs, token, pos, k, dst)
}

// headIO reads and writes one KV head of one position of a request, in one
// cache or across a TP group's shard caches, each of which holds a range
// of the heads (every shard that holds a head gets its writes).
type headIO struct {
	cs     []Cache
	h0, h1 []int // heads [h0, h1) of each shard
}

func newHeadIO(cs []Cache, heads int) headIO {
	io := headIO{cs: cs, h0: make([]int, len(cs)), h1: make([]int, len(cs))}
	for r := range cs {
		io.h0[r], io.h1[r] = 0, heads
		if len(cs) > 1 {
			io.h0[r], io.h1[r] = holdsN(heads, len(cs), r)
		}
	}
	return io
}

// at returns head h of position pos, layer l, half kv, in shard r's cache.
func (io headIO) at(r, l int, kv kvcache.KV, pos, h int) []byte {
	c := &io.cs[r]
	tpb := c.KV.TokensPerBlock
	off := c.KV.TokenOffset(c.Blocks[pos/tpb], l, kv, pos%tpb, h-io.h0[r])
	return c.KVArena[off : off+int64(c.KV.HeadDim*c.KV.ElemSize)]
}

func (io headIO) read(dst []float32, l int, kv kvcache.KV, pos, h int) {
	for r := range io.cs {
		if h >= io.h0[r] && h < io.h1[r] {
			loadF32s(dst, io.at(r, l, kv, pos, h))
			return
		}
	}
}

// readAll reads positions [0, n) of every head of layer l, half kv, into
// dst as [n][heads][head_dim]: one offset per block and shard, not one per
// head and position.
func (io headIO) readAll(dst []float32, l int, kv kvcache.KV, n, heads int) {
	hd := io.cs[0].KV.HeadDim
	for r := range io.cs {
		c := &io.cs[r]
		h0, h1 := io.h0[r], io.h1[r]
		if r > 0 && h0 == io.h0[r-1] {
			continue // a replica of the shard before
		}
		tpb := c.KV.TokensPerBlock
		var slot, head int64
		if tpb > 1 {
			slot = c.KV.TokenOffset(c.Blocks[0], l, kv, 1, 0) - c.KV.TokenOffset(c.Blocks[0], l, kv, 0, 0)
		}
		if h1-h0 > 1 {
			head = c.KV.TokenOffset(c.Blocks[0], l, kv, 0, 1) - c.KV.TokenOffset(c.Blocks[0], l, kv, 0, 0)
		}
		for b := 0; b*tpb < n; b++ {
			base := c.KV.TokenOffset(c.Blocks[b], l, kv, 0, 0)
			for t := b * tpb; t < min(n, (b+1)*tpb); t++ {
				for h := h0; h < h1; h++ {
					off := base + int64(t-b*tpb)*slot + int64(h-h0)*head
					loadF32s(dst[(t*heads+h)*hd:(t*heads+h+1)*hd], c.KVArena[off:])
				}
			}
		}
	}
}

func (io headIO) write(src []float32, l int, kv kvcache.KV, pos, h int) {
	for r := range io.cs {
		if h >= io.h0[r] && h < io.h1[r] {
			putF32s(io.at(r, l, kv, pos, h), src)
		}
	}
}

// tinyMTP is tiny-hybrid's draft head. Its attention and MLP are the
// target's last attention and MLP layers (tied, as a distilled head would
// be close to them), so it predicts much as the top of the target does;
// its own weights are the projection of the target's context into the
// token's embedding. Its KV layer is the pool's last.
type tinyMTP struct {
	proj      []float32 // [dModel][kvHeads·headDim]
	attn, mlp *tinyLayer
	kvLayer   int // its KV layer
	ctxLayer  int // the target's last attention layer (KV index)
}

// mtpScratch holds one draft call's activations and its drafts' entries.
type mtpScratch struct {
	h, xn, out, ctx []float32
	q, k, v, att    []float32
	up, gate        []float32
	scores          []float32
	ks, vs          [][]float32 // the drafts' own entries, from position pos
	// A one-cache headIO's backing, so that a target step allocates none.
	oneC [1]Cache
	oneH [2][1]int
}

// one returns a headIO over c alone, backed by s.
func (s *mtpScratch) one(c Cache, heads int) headIO {
	s.oneC[0], s.oneH[0][0], s.oneH[1][0] = c, 0, heads
	return headIO{cs: s.oneC[:], h0: s.oneH[0][:], h1: s.oneH[1][:]}
}

// newMTPScratch returns the scratch of a target step's entry (k 0: what
// mtpEntry uses) or of a Draft of k drafts (the attention and MLP too,
// scores for a query head group over the whole context).
func (m *tiny) newMTPScratch(k int) *mtpScratch {
	d := &m.d
	s := &mtpScratch{
		h: make([]float32, d.dModel), xn: make([]float32, d.dModel), out: make([]float32, d.dModel),
		ctx: make([]float32, d.kvHeads*d.headDim),
		k:   make([]float32, d.kvHeads*d.headDim), v: make([]float32, d.kvHeads*d.headDim),
	}
	if k == 0 {
		return s
	}
	s.q, s.att = make([]float32, d.qHeads*d.headDim), make([]float32, d.qHeads*d.headDim)
	s.up, s.gate = make([]float32, d.mlpHidden), make([]float32, d.mlpHidden)
	s.scores = make([]float32, d.qHeads/d.kvHeads*d.maxContext)
	for range k {
		s.ks = append(s.ks, make([]float32, d.kvHeads*d.headDim))
		s.vs = append(s.vs, make([]float32, d.kvHeads*d.headDim))
	}
	return s
}

// mtpIn sets s.h to the draft layer's input at pos for token, its context
// ctx (the target's V at pos-1, or the previous draft's), and s.k, s.v to
// the entry's K (rotated) and V.
func (m *tiny) mtpIn(s *mtpScratch, token int32, pos int, ctx []float32) {
	dm, hd := m.d.dModel, m.d.headDim
	copy(s.h, m.embed[int(token)*dm:(int(token)+1)*dm])
	matVec(s.out, m.mtp.proj, ctx)
	addTo(s.h, s.out)
	rmsNorm(s.xn, s.h, m.mtp.attn.norm)
	matVec(s.k, m.mtp.attn.wk, s.xn)
	matVec(s.v, m.mtp.attn.wv, s.xn)
	for h := range m.d.kvHeads {
		m.rotate(s.k[h*hd:(h+1)*hd], pos)
	}
}

// mtpContext reads the target's context for the entry at pos: the V of
// its last attention layer at pos-1, zero at position 0.
func (m *tiny) mtpContext(io headIO, dst []float32, pos int) {
	if pos == 0 {
		clear(dst)
		return
	}
	hd := m.d.headDim
	for h := range m.d.kvHeads {
		io.read(dst[h*hd:(h+1)*hd], m.mtp.ctxLayer, kvcache.V, pos-1, h)
	}
}

// mtpEntry writes the draft layer's entry (K and V) of position pos, where
// the target processes token: part of every target step.
func (m *tiny) mtpEntry(io headIO, s *mtpScratch, token int32, pos int) {
	m.mtpContext(io, s.ctx, pos)
	m.mtpIn(s, token, pos, s.ctx)
	hd := m.d.headDim
	for h := range m.d.kvHeads {
		io.write(s.k[h*hd:(h+1)*hd], m.mtp.kvLayer, kvcache.K, pos, h)
		io.write(s.v[h*hd:(h+1)*hd], m.mtp.kvLayer, kvcache.V, pos, h)
	}
}

// draftShards implements drafter.
func (m *tiny) draftShards(cs []Cache, token int32, pos, k int, dst []int32) ([]int32, error) {
	if len(cs) > 1 {
		if err := m.checkTP(len(cs)); err != nil {
			return dst, err
		}
	}
	d := &m.d
	hd, dm := d.headDim, d.dModel
	io := newHeadIO(cs, d.kvHeads)
	s := m.newMTPScratch(k)
	m.mtpContext(io, s.ctx, pos)
	scale := float32(1 / math.Sqrt(float64(hd)))
	group := d.qHeads / d.kvHeads
	logits := make([]float32, m.spec.Vocab)
	pk, pv := make([]float32, pos*d.kvHeads*hd), make([]float32, pos*d.kvHeads*hd)
	io.readAll(pk, m.mtp.kvLayer, kvcache.K, pos, d.kvHeads)
	io.readAll(pv, m.mtp.kvLayer, kvcache.V, pos, d.kvHeads)
	for i := range k {
		p := pos + i
		m.mtpIn(s, token, p, s.ctx)
		copy(s.ks[i], s.k)
		copy(s.vs[i], s.v)
		matVec(s.q, m.mtp.attn.wq, s.xn)
		for h := range d.qHeads {
			m.rotate(s.q[h*hd:(h+1)*hd], p)
		}
		// Attention over the entries [0, p]: the pool's before pos (read
		// once for all the drafts), the drafts' own from pos.
		n := p + 1
		w := d.kvHeads * hd
		head := func(kv kvcache.KV, t, kh int) []float32 {
			src := pk
			switch {
			case t >= pos && kv == kvcache.K:
				src, t = s.ks[t-pos], 0
			case t >= pos:
				src, t = s.vs[t-pos], 0
			case kv == kvcache.V:
				src = pv
			}
			return src[t*w+kh*hd : t*w+(kh+1)*hd]
		}
		for kh := range d.kvHeads {
			scores := s.scores[:n*group]
			for t := range n {
				kt := head(kvcache.K, t, kh)
				for g := range group {
					qh := kh*group + g
					scores[g*n+t] = float32(dot(s.q[qh*hd:(qh+1)*hd], kt) * scale)
				}
			}
			for g := range group {
				softmax(scores[g*n : (g+1)*n])
				clear(s.att[(kh*group+g)*hd : (kh*group+g+1)*hd])
			}
			for t := range n {
				vt := head(kvcache.V, t, kh)
				for g := range group {
					qh := kh*group + g
					axpy(s.att[qh*hd:(qh+1)*hd], scores[g*n+t], vt)
				}
			}
		}
		matVec(s.out, m.mtp.attn.wo, s.att)
		addTo(s.h, s.out)
		rmsNorm(s.xn, s.h, m.mtp.mlp.norm)
		matVec(s.up, m.mtp.mlp.up, s.xn)
		matVec(s.gate, m.mtp.mlp.gate, s.xn)
		for j := range s.up {
			s.up[j] = float32(silu(s.gate[j]) * s.up[j])
		}
		matVec(s.out, m.mtp.mlp.down, s.up)
		addTo(s.h, s.out)
		rmsNorm(s.xn, s.h, m.final)
		for v := range logits {
			logits[v] = dot(m.head[v*dm:(v+1)*dm], s.xn) + m.prior[v]
		}
		token = argmax(logits)
		dst = append(dst, token)
		copy(s.ctx, s.vs[i]) // the next draft's context is this one's V
	}
	return dst, nil
}

// draftShards implements drafter for the synthetic presets, with fake
// math as theirs is: each draft is the greedy pick of logits seeded by the
// draft layer's K of head 0 at pos-1 (shard 0 holds head 0 at every TP
// size), the token and the position. The drafts are deterministic and
// rarely right, as the presets' tokens are a hash of the whole state.
func (s *synthetic) draftShards(cs []Cache, token int32, pos, k int, dst []int32) ([]int32, error) {
	c := &cs[0]
	tpb := c.KV.TokensPerBlock
	off := c.KV.TokenOffset(c.Blocks[(pos-1)/tpb], s.spec.KV.Layers-1, kvcache.K, (pos-1)%tpb, 0)
	h := mix64(s.base, uint64(crc32.Checksum(c.KVArena[off:off+int64(c.KV.HeadDim*c.KV.ElemSize)], castagnoli)))
	for i := range k {
		h = mix64(h, uint64(uint32(token))<<32|uint64(pos+i))
		token = argmax(s.logits(h))
		dst = append(dst, token)
	}
	return dst, nil
}
