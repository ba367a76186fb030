package model

import (
	"context"
	"fmt"
	"math"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/reshard"
)

// acc4 is the running state of dot: its four interleaved partial sums.
// Adding segments in order [0, a), [a, b), ... with every segment a
// multiple of 4 long performs exactly dot's additions, so a row-parallel
// product reduced across shards in shard order equals the unsharded one.
type acc4 [4]float32

func (s *acc4) add(a, b []float32) {
	b = b[:len(a)]
	for i := 0; i+4 <= len(a); i += 4 {
		s[0] += float32(a[i] * b[i])
		s[1] += float32(a[i+1] * b[i+1])
		s[2] += float32(a[i+2] * b[i+2])
		s[3] += float32(a[i+3] * b[i+3])
	}
}

func (s *acc4) sum() float32 { return (s[0] + s[1]) + (s[2] + s[3]) }

// tinyShard is what one shard of a TP-tp group owns of tiny-hybrid.
type tinyShard struct {
	mh0, mh1 int // Mamba heads
	g0, g1   int // groups (one, replicated, when tp > nGroups)
	qh0, qh1 int // query heads
	kv0, kv1 int // KV heads (one, replicated, when tp > kvHeads)
	f0, f1   int // MLP hidden units
	row      rowView
	// Per-shard activations, indexed locally.
	z, x, dt, y, conv []float32
	q, k, v, att      []float32
	up, gate          []float32
}

func holdsN(n, tp, r int) (int, int) { return reshard.Holds(reshard.Section{Items: n}, tp, r) }

func (m *tiny) checkTP(tp int) error {
	d := &m.d
	if tp < 1 || d.qHeads%tp != 0 || d.mlpHidden%tp != 0 {
		return fmt.Errorf("%w: %s at TP %d: %d query heads and %d MLP units must split evenly", ErrInvalidCache, m.spec.Name, tp, d.qHeads, d.mlpHidden)
	}
	// Row-parallel segments must be whole steps of dot's four partial sums.
	if (m.dInner/tp)%4 != 0 || (d.qHeads*d.headDim/tp)%4 != 0 || (d.mlpHidden/tp)%4 != 0 {
		return fmt.Errorf("%w: %s at TP %d: a row-parallel segment is not a multiple of 4", ErrInvalidCache, m.spec.Name, tp)
	}
	return nil
}

// bindShards checks cs against the shard shapes for a request of tokens
// positions and returns the shards with their rows bound.
func (m *tiny) bindShards(cs []Cache, tokens int) ([]tinyShard, error) {
	tp := len(cs)
	if err := m.checkTP(tp); err != nil {
		return nil, err
	}
	spec, err := ShardSpec(m.spec, tp)
	if err != nil {
		return nil, err
	}
	d := &m.d
	sh := make([]tinyShard, tp)
	for r := range sh {
		s := &sh[r]
		if err := checkCache(&spec, &cs[r], tokens, &s.row); err != nil {
			return nil, fmt.Errorf("shard %d: %w", r, err)
		}
		if r > 0 && (cs[r].Row != cs[0].Row || !sameBlocks(cs[r].Blocks, cs[0].Blocks, cs[0].KV.BlocksFor(tokens))) {
			return nil, fmt.Errorf("%w: shard %d holds other blocks or another row than shard 0", ErrInvalidCache, r)
		}
		s.mh0, s.mh1 = holdsN(d.mHeads, tp, r)
		s.g0, s.g1 = holdsN(d.nGroups, tp, r)
		s.qh0, s.qh1 = holdsN(d.qHeads, tp, r)
		s.kv0, s.kv1 = holdsN(d.kvHeads, tp, r)
		s.f0, s.f1 = holdsN(d.mlpHidden, tp, r)
		hd := d.mHeadDim
		nh := s.mh1 - s.mh0
		s.z, s.x, s.y = make([]float32, nh*hd), make([]float32, nh*hd), make([]float32, nh*hd)
		s.dt = make([]float32, nh)
		s.conv = make([]float32, 2*(s.g1-s.g0)*d.dState)
		s.q = make([]float32, (s.qh1-s.qh0)*d.headDim)
		s.att = make([]float32, len(s.q))
		s.k = make([]float32, (s.kv1-s.kv0)*d.headDim)
		s.v = make([]float32, len(s.k))
		s.up, s.gate = make([]float32, s.f1-s.f0), make([]float32, s.f1-s.f0)
	}
	return sh, nil
}

func sameBlocks(a, b []kvcache.BlockID, n int) bool {
	if len(a) < n || len(b) < n {
		return false
	}
	for i := range n {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// PrefillShards implements ShardedExecutor.
func (m *tiny) PrefillShards(cs []Cache, tokens []int32) ([]float32, error) {
	if err := checkPrompt(&m.spec, tokens); err != nil {
		return nil, err
	}
	sh, err := m.bindShards(cs, len(tokens))
	if err != nil {
		return nil, err
	}
	ts := m.newTPScratch()
	logits := make([]float32, m.spec.Vocab)
	last := len(tokens) - 1
	for pos, t := range tokens {
		if pos == last {
			m.stepShards(cs, sh, ts, t, pos, logits)
		} else {
			m.stepShards(cs, sh, ts, t, pos, nil)
		}
	}
	return logits, nil
}

// DecodeShards implements ShardedExecutor.
func (m *tiny) DecodeShards(cs []Cache, token int32, pos int) ([]float32, error) {
	if err := checkToken(&m.spec, token); err != nil {
		return nil, err
	}
	if err := checkPos(&m.spec, pos); err != nil {
		return nil, err
	}
	sh, err := m.bindShards(cs, pos+1)
	if err != nil {
		return nil, err
	}
	logits := make([]float32, m.spec.Vocab)
	m.stepShards(cs, sh, m.newTPScratch(), token, pos, logits)
	return logits, nil
}

// tpScratch holds the replicated activations (the residual stream) and the
// row-parallel accumulators.
type tpScratch struct {
	mtp        *mtpScratch // with a draft head
	h, xn, out []float32
	acc        []acc4
	scores     []float32
	kt         []float32
}

func (m *tiny) newTPScratch() *tpScratch {
	d := &m.d
	var ms *mtpScratch
	if m.mtp != nil {
		ms = m.newMTPScratch(0)
	}
	return &tpScratch{mtp: ms,
		h: make([]float32, d.dModel), xn: make([]float32, d.dModel), out: make([]float32, d.dModel),
		acc: make([]acc4, d.dModel), scores: make([]float32, d.maxContext), kt: make([]float32, d.headDim),
	}
}

// stepShards is step over the shards: the same arithmetic, each shard
// computing its heads, the row-parallel sums chained across shards.
func (m *tiny) stepShards(cs []Cache, sh []tinyShard, ts *tpScratch, token int32, pos int, logits []float32) {
	if pos == 0 {
		for i := range sh {
			sh[i].row.zero()
		}
	}
	dm := m.d.dModel
	copy(ts.h, m.embed[int(token)*dm:(int(token)+1)*dm])
	mi, ai := 0, 0
	for i := range m.layers {
		m.layerShards(cs, sh, ts, &m.layers[i], mi, ai, pos, ts.h)
		switch m.layers[i].kind {
		case 'M':
			mi++
		case '*':
			ai++
		}
	}
	if m.mtp != nil {
		m.mtpEntry(newHeadIO(cs, m.d.kvHeads), ts.mtp, token, pos)
	}
	if logits == nil {
		return
	}
	m.headOf(logits, ts.xn, ts.h)
}

// layerShards runs layer l (the mi-th Mamba layer, the ai-th attention
// layer) over the shards at position pos: h, the replicated hidden state,
// goes in and comes out with the layer's output added.
func (m *tiny) layerShards(cs []Cache, sh []tinyShard, ts *tpScratch, l *tinyLayer, mi, ai, pos int, h []float32) {
	rmsNorm(ts.xn, h, l.norm)
	clear(ts.acc)
	switch l.kind {
	case 'M':
		for r := range sh {
			m.mambaShard(l, &sh[r], mi, ts)
		}
	case '*':
		for r := range sh {
			m.attentionShard(l, ai, &cs[r], &sh[r], pos, ts)
		}
	case '-':
		for r := range sh {
			m.mlpShard(l, &sh[r], ts)
		}
	}
	for j := range ts.out {
		ts.out[j] = ts.acc[j].sum()
	}
	addTo(h, ts.out)
}

// headOf writes the next-token logits of hidden state h (xn is scratch).
func (m *tiny) headOf(logits, xn, h []float32) {
	dm := m.d.dModel
	rmsNorm(xn, h, m.final)
	for v := range logits {
		logits[v] = dot(m.head[v*dm:(v+1)*dm], xn) + m.prior[v]
	}
}

// prefillChunkShards is prefillChunk over the shards: every position of
// the chunk passes layer i on every shard before any passes layer i+1,
// each (layer, position) computing exactly what stepShards computes, so
// caches and logits are bit-identical to PrefillShards'.
func (m *tiny) prefillChunkShards(ctx context.Context, cs []Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error) {
	sh, err := m.bindShards(cs, to)
	if err != nil {
		return nil, err
	}
	if from == 0 {
		for i := range sh {
			sh[i].row.zero()
		}
	}
	dm := m.d.dModel
	hs := make([]float32, (to-from)*dm) // the chunk's hidden states
	for p := from; p < to; p++ {
		copy(hs[(p-from)*dm:(p-from+1)*dm], m.embed[int(tokens[p])*dm:(int(tokens[p])+1)*dm])
	}
	ts := m.newTPScratch()
	mi, ai := 0, 0
	for i := range m.layers {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("model: prefill: %w", err)
		}
		l := &m.layers[i]
		for p := from; p < to; p++ {
			m.layerShards(cs, sh, ts, l, mi, ai, p, hs[(p-from)*dm:(p-from+1)*dm])
		}
		switch l.kind {
		case 'M':
			mi++
		case '*':
			ai++
		}
		if err := done(i); err != nil {
			return nil, err
		}
	}
	if m.mtp != nil {
		io := newHeadIO(cs, m.d.kvHeads)
		for p := from; p < to; p++ {
			m.mtpEntry(io, ts.mtp, tokens[p], p)
		}
		if err := done(len(m.layers)); err != nil {
			return nil, err
		}
	}
	if to != len(tokens) {
		return nil, nil
	}
	logits := make([]float32, m.spec.Vocab)
	m.headOf(logits, ts.xn, hs[(to-1-from)*dm:])
	return logits, nil
}

// rowParallel adds w[:, c0:c0+len(in)] · in to the accumulators: this
// shard's part of a row-parallel product, in shard order.
func rowParallel(acc []acc4, w []float32, cols, c0 int, in []float32) {
	for r := range acc {
		acc[r].add(w[r*cols+c0:r*cols+c0+len(in)], in)
	}
}

// convTap is one channel's causal conv step (as in mamba): the window's
// older d_conv-1 inputs from st at base, then the current input x.
func convTap(w []float32, bias float32, st []byte, base, km1 int, x float32) float32 {
	acc := bias
	for t := range km1 {
		acc += float32(w[t] * f32At(st, base+t))
	}
	acc += float32(w[km1] * x)
	for t := 0; t < km1-1; t++ {
		putF32(st, base+t, f32At(st, base+t+1))
	}
	putF32(st, base+km1-1, x)
	return silu(acc)
}

// mambaShard is mamba for the heads and groups of one shard.
func (m *tiny) mambaShard(l *tinyLayer, s *tinyShard, layer int, ts *tpScratch) {
	d := &m.d
	dm, hd, n, km1 := d.dModel, d.mHeadDim, d.dState, d.dConv-1
	gs := d.nGroups * n
	row := func(i int) []float32 { return l.inProj[i*dm : (i+1)*dm] }
	conv := s.row.conv[layer]
	tap := func(ch int, st []byte, j int, x float32) float32 {
		return convTap(l.convW[ch*d.dConv:(ch+1)*d.dConv], l.convB[ch], st, j*km1, km1, x)
	}
	c0 := s.mh0 * hd
	for j := range s.x {
		i := c0 + j
		s.z[j] = dot(row(i), ts.xn)
		s.x[j] = tap(i, conv[0], j, dot(row(m.dInner+i), ts.xn))
	}
	ng := s.g1 - s.g0
	bs, cs := s.conv[:ng*n], s.conv[ng*n:]
	for j := range ng * n {
		ch := m.dInner + s.g0*n + j
		bs[j] = tap(ch, conv[1], j, dot(row(m.dInner+ch), ts.xn))
	}
	for j := range ng * n {
		ch := m.dInner + gs + s.g0*n + j
		cs[j] = tap(ch, conv[2], j, dot(row(m.dInner+ch), ts.xn))
	}
	perGroup := d.mHeads / d.nGroups
	ssm := s.row.ssm[layer]
	for lh := range s.mh1 - s.mh0 {
		h := s.mh0 + lh
		dt := softplus(dot(row(m.dInner+m.conv+h), ts.xn) + l.dtBias[h])
		dA := exp32(float32(dt * l.a[h]))
		g := h/perGroup - s.g0
		bg, cg := bs[g*n:(g+1)*n], cs[g*n:(g+1)*n]
		for p := range hd {
			i := lh*hd + p
			xv := s.x[i]
			dtx := float32(dt * xv)
			st := ssm[i*n*4 : (i+1)*n*4]
			var acc float32
			for k := range n {
				v := float32(dA*f32At(st, k)) + float32(dtx*bg[k])
				putF32(st, k, v)
				acc += float32(cg[k] * v)
			}
			s.y[i] = (acc + float32(l.d[h]*xv)) * silu(s.z[i])
		}
	}
	rowParallel(ts.acc, l.outProj, m.dInner, c0, s.y)
}

// attentionShard is attention for the query heads of one shard, over the
// KV heads it holds in its own cache c.
func (m *tiny) attentionShard(l *tinyLayer, layer int, c *Cache, s *tinyShard, pos int, ts *tpScratch) {
	d := &m.d
	hd, dm := d.headDim, d.dModel
	for j := range s.q {
		s.q[j] = dot(l.wq[(s.qh0*hd+j)*dm:(s.qh0*hd+j+1)*dm], ts.xn)
	}
	for j := range s.k {
		s.k[j] = dot(l.wk[(s.kv0*hd+j)*dm:(s.kv0*hd+j+1)*dm], ts.xn)
		s.v[j] = dot(l.wv[(s.kv0*hd+j)*dm:(s.kv0*hd+j+1)*dm], ts.xn)
	}
	for h := range s.qh1 - s.qh0 {
		m.rotate(s.q[h*hd:(h+1)*hd], pos)
	}
	for h := range s.kv1 - s.kv0 {
		m.rotate(s.k[h*hd:(h+1)*hd], pos)
	}
	tpb := c.KV.TokensPerBlock
	blk, slot := c.Blocks[pos/tpb], pos%tpb
	for h := range s.kv1 - s.kv0 {
		putF32s(c.KVArena[c.KV.TokenOffset(blk, layer, kvcache.K, slot, h):], s.k[h*hd:(h+1)*hd])
		putF32s(c.KVArena[c.KV.TokenOffset(blk, layer, kvcache.V, slot, h):], s.v[h*hd:(h+1)*hd])
	}
	scale := float32(1 / math.Sqrt(float64(hd)))
	group := d.qHeads / d.kvHeads
	n := pos + 1
	kt := ts.kt[:hd]
	scores := ts.scores[:n]
	for lq := range s.qh1 - s.qh0 {
		qh := s.qh0 + lq
		kh := qh/group - s.kv0
		q := s.q[lq*hd : (lq+1)*hd]
		for t := range n {
			loadF32s(kt, c.KVArena[c.KV.TokenOffset(c.Blocks[t/tpb], layer, kvcache.K, t%tpb, kh):])
			scores[t] = float32(dot(q, kt) * scale)
		}
		softmax(scores)
		att := s.att[lq*hd : (lq+1)*hd]
		clear(att)
		for t := range n {
			loadF32s(kt, c.KVArena[c.KV.TokenOffset(c.Blocks[t/tpb], layer, kvcache.V, t%tpb, kh):])
			axpy(att, scores[t], kt)
		}
	}
	rowParallel(ts.acc, l.wo, d.qHeads*hd, s.qh0*hd, s.att)
}

// mlpShard is the MLP for the hidden units of one shard.
func (m *tiny) mlpShard(l *tinyLayer, s *tinyShard, ts *tpScratch) {
	dm := m.d.dModel
	for j := range s.up {
		i := s.f0 + j
		s.up[j] = dot(l.up[i*dm:(i+1)*dm], ts.xn)
		s.gate[j] = dot(l.gate[i*dm:(i+1)*dm], ts.xn)
	}
	for j := range s.up {
		s.up[j] = float32(silu(s.gate[j]) * s.up[j])
	}
	rowParallel(ts.acc, l.down, m.d.mlpHidden, s.f0, s.up)
}
