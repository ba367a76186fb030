package model

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/reshard"
)

// Tensor parallelism. A TP-N worker keeps a request's cache on N shards,
// each in its own pools, with the shapes ShardSpec gives: the KV heads, Mamba
// heads, groups and conv sections it would hold on its own GPU, laid out as
// package reshard describes (a replicated KV head or group when N exceeds
// their count). PrefillShards and DecodeShards run a model over the N caches
// of one request, in shard order.
//
// tiny-hybrid runs sharded for real: each shard computes the rows of the
// column-parallel projections (z|x B C|dt, Q, K, V, the MLP's up and gate)
// that feed its own heads and state, and the row-parallel projections (the
// Mamba and attention out-projections, the MLP's down-projection) are
// reduced across shards in one fixed order: the four interleaved partial
// sums of a dot product are carried from shard 0 to shard N-1 (chain),
// exactly as one shard sums them alone. So every reduction adds the same
// numbers in the same order whatever N is, and TP 1, 2 and 4 give
// bit-identical logits and, read back through reshard, bit-identical caches.
// The synthetic presets gather the shards into one TP-1 view, run, and
// scatter back (their fake math reads whole rows).

// ShardedExecutor is an Executor that runs over a tensor-parallel group's
// shard caches itself (see ShardSpec). cs holds one Cache per shard, in
// shard order, each with that shard's pool configs; every shard holds the
// same blocks and row ids.
type ShardedExecutor interface {
	Executor
	PrefillShards(cs []Cache, tokens []int32) ([]float32, error)
	DecodeShards(cs []Cache, token int32, pos int) ([]float32, error)
}

// ShardSpec returns the cache shapes of one shard of a TP-tp group running
// spec: KV and Mamba split by reshard.KVShard and reshard.MambaShard. An
// error wraps ErrInvalidCache and the reshard sentinel, and names the
// dimension that does not split.
func ShardSpec(spec Spec, tp int) (Spec, error) {
	if tp == 1 {
		return spec, nil
	}
	if spec.KV.Layers > 0 {
		kv, err := reshard.KVShard(spec.KV, tp)
		if err != nil {
			return Spec{}, fmt.Errorf("%w: %s at TP %d: %w", ErrInvalidCache, spec.Name, tp, err)
		}
		spec.KV = kv
	}
	if spec.Mamba.Layers > 0 {
		m, err := reshard.MambaShard(spec.Mamba, tp)
		if err != nil {
			return Spec{}, fmt.Errorf("%w: %s at TP %d: %w", ErrInvalidCache, spec.Name, tp, err)
		}
		spec.Mamba = m
	}
	return spec, nil
}

// CheckTP reports whether e can run at tensor-parallel size tp: its caches
// split (ShardSpec) and, for tiny-hybrid, its query heads and the
// row-parallel reductions too. The error names what does not split.
func CheckTP(e Executor, tp int) error {
	if _, err := ShardSpec(e.Spec(), tp); err != nil {
		return err
	}
	if m, ok := unwrap(e).(*tiny); ok {
		return m.checkTP(tp)
	}
	return nil
}

// PrefillShards runs e.Prefill over the shard caches of one request and
// returns the logits of the next token, the same for every len(cs) the
// model splits over. One cache is a plain PrefillContext.
func PrefillShards(ctx context.Context, e Executor, cs []Cache, tokens []int32) ([]float32, error) {
	if len(cs) == 1 {
		return PrefillContext(ctx, e, cs[0], tokens)
	}
	inner, pd, _ := delays(e)
	if err := sleep(ctx, time.Duration(len(tokens))*pd); err != nil {
		return nil, fmt.Errorf("model: prefill: %w", err)
	}
	if se, ok := inner.(ShardedExecutor); ok {
		return se.PrefillShards(cs, tokens)
	}
	return viaTP1(inner, cs, len(tokens), func(c Cache) ([]float32, error) { return inner.Prefill(c, tokens) })
}

// DecodeShards runs e.Decode over the shard caches of one request.
func DecodeShards(ctx context.Context, e Executor, cs []Cache, token int32, pos int) ([]float32, error) {
	if len(cs) == 1 {
		return DecodeContext(ctx, e, cs[0], token, pos)
	}
	inner, _, dd := delays(e)
	if err := sleep(ctx, dd); err != nil {
		return nil, fmt.Errorf("model: decode: %w", err)
	}
	if se, ok := inner.(ShardedExecutor); ok {
		return se.DecodeShards(cs, token, pos)
	}
	return viaTP1(inner, cs, pos+1, func(c Cache) ([]float32, error) { return inner.Decode(c, token, pos) })
}

// delays strips the wrappers that only time a call (delayed, timed).
func delays(e Executor) (inner Executor, prefill, decode time.Duration) {
	switch w := e.(type) {
	case *delayed:
		return w.inner, w.prefill, w.decode
	case timed:
		return w.Executor, 0, 0
	}
	return e, 0, 0
}

func unwrap(e Executor) Executor {
	inner, _, _ := delays(e)
	return inner
}

// viaTP1 runs call on a TP-1 copy of the shards' caches: it gathers the
// request's blocks and row into a scratch TP-1 cache with the plan tp→1,
// runs call, and scatters the result back with the plan 1→tp. The bytes
// the model sees and leaves are those of a TP-1 run.
func viaTP1(e Executor, cs []Cache, tokens int, call func(Cache) ([]float32, error)) ([]float32, error) {
	v, err := newTP1View(e, cs, tokens, true)
	if err != nil {
		return nil, err
	}
	defer v.release()
	logits, err := call(v.one)
	if err != nil {
		return nil, err
	}
	v.scatterAll()
	return logits, nil
}

// tp1View is a TP-1 scratch copy of a request's cache on a TP group's
// shards (viaTP1).
type tp1View struct {
	one         Cache
	cs          []Cache
	nb          int // the request's blocks
	kvOut, mOut *reshard.Plan
	mRowBytes   int64 // of one row of a shard's Mamba unit
}

// newTP1View checks the shards' caches for a request of tokens positions
// and returns a TP-1 view of them: gathered, or zero where the caller
// overwrites what it scatters back (!gather).
func newTP1View(e Executor, cs []Cache, tokens int, gather bool) (*tp1View, error) {
	spec := e.Spec()
	tp := len(cs)
	shard, err := ShardSpec(spec, tp)
	if err != nil {
		return nil, err
	}
	tpb := cs[0].KV.TokensPerBlock
	for i := range cs {
		var rv rowView
		sh := shard
		sh.KV.TokensPerBlock = tpb
		if err := checkCache(&sh, &cs[i], tokens, &rv); err != nil {
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
	}
	kv := spec.KV
	kv.TokensPerBlock, kv.ByteBudget = tpb, 0
	nb := 0
	if kv.Layers > 0 {
		nb = kv.BlocksFor(tokens)
	}
	kv.Blocks = max(nb, 1)
	mc := spec.Mamba
	mc.MaxBatchSize, mc.PPSize, mc.AttentionDP = 1, 1, false
	v := &tp1View{one: Cache{KV: kv, Mamba: mc, Row: 0}, cs: cs, nb: nb}
	if kv.Layers > 0 {
		v.one.KVArena = scratchBytes(kv.ArenaBytes())
		for b := range nb {
			v.one.Blocks = append(v.one.Blocks, kvcache.BlockID(b))
		}
	}
	if mc.Layers > 0 {
		v.one.MambaArena = scratchBytes(mc.ArenaBytes())
	}
	kvIn, kvOut, mIn, mOut, err := tp1Plans(spec, kv, tp)
	if err != nil {
		return nil, err
	}
	v.kvOut, v.mOut = kvOut, mOut
	if mOut != nil {
		v.mRowBytes = mOut.Layout.RowBytes(tp)
	}
	if !gather {
		return v, nil
	}
	if kvIn != nil {
		for i := range nb {
			for r := range cs {
				reshard.Apply(v.unit(&v.one, true, i), v.unit(&cs[r], true, i), kvIn.Copies(r, 0))
			}
		}
	}
	if mIn != nil {
		for r := range cs {
			reshard.Apply(v.unit(&v.one, false, 0), v.unit(&cs[r], false, 0), mIn.Copies(r, 0))
		}
	}
	return v, nil
}

// scratch keeps the arenas of TP-1 views between calls (*[]byte): a
// view's bytes are all gathered or all written before they are read, so a
// reused arena needs no clearing, and a synthetic 4k-token view is 113 MiB.
var scratch sync.Pool

// scratchBytes returns n bytes of scratch, of unspecified content.
func scratchBytes(n int64) []byte {
	if b, ok := scratch.Get().(*[]byte); ok {
		if int64(cap(*b)) >= n {
			return (*b)[:n]
		}
		scratch.Put(b) // too small for this one; another view may fit
	}
	return make([]byte, n)
}

// release returns v's arenas to scratch; v is not used after.
func (v *tp1View) release() {
	for _, b := range [][]byte{v.one.KVArena, v.one.MambaArena} {
		if cap(b) > 0 {
			scratch.Put(&b)
		}
	}
	v.one.KVArena, v.one.MambaArena = nil, nil
}

// unit is block i of c's request (kvUnit), else its Mamba row.
func (v *tp1View) unit(c *Cache, kvUnit bool, i int) []byte {
	if kvUnit {
		x := c.KV.BlockExtent(c.Blocks[i])
		return c.KVArena[x.Offset : x.Offset+x.Length]
	}
	x := c.Mamba.RowExtent(c.Row)
	return c.MambaArena[x.Offset : x.Offset+x.Length]
}

// scatterAll copies the whole view back to the shards.
func (v *tp1View) scatterAll() {
	if v.kvOut != nil {
		for i := range v.nb {
			for r := range v.cs {
				reshard.Apply(v.unit(&v.cs[r], true, i), v.unit(&v.one, true, i), v.kvOut.Copies(0, r))
			}
		}
	}
	if v.mOut != nil {
		for r := range v.cs {
			reshard.Apply(v.unit(&v.cs[r], false, 0), v.unit(&v.one, false, 0), v.mOut.Copies(0, r))
		}
	}
}

// scatterMamba copies back Mamba layer layer: one row of the unit in
// package reshard's layout.
func (v *tp1View) scatterMamba(layer int) {
	if v.mOut == nil {
		return
	}
	lo := int64(layer) * v.mRowBytes
	for r := range v.cs {
		reshard.ApplyRange(v.unit(&v.cs[r], false, 0), v.unit(&v.one, false, 0), v.mOut.Copies(0, r), lo, lo+v.mRowBytes)
	}
}

// scatterKV copies back the K and V of KV layer layer at positions
// [from, to): in each block that holds them, the slots of each head of the
// layer's K and V rows.
func (v *tp1View) scatterKV(layer, from, to int) {
	if v.kvOut == nil {
		return
	}
	t := v.one.KV.TokensPerBlock
	for k := from / t; k*t < to && k < v.nb; k++ {
		s0, s1 := int64(max(from, k*t)-k*t), int64(min(to, (k+1)*t)-k*t)
		for lo, hi := range reshard.LayerSlots(v.kvOut, t, layer, s0, s1) {
			for r := range v.cs {
				reshard.ApplyRange(v.unit(&v.cs[r], true, k), v.unit(&v.one, true, k), v.kvOut.Copies(0, r), lo, hi)
			}
		}
	}
}

// prefillChunk implements chunker for a TP group: the group runs the chunk
// layer by layer, its simulated compute spread over the layers as
// delayed's is, and reports a layer done once every shard holds it.
// tiny-hybrid runs sharded; the synthetic presets run on a TP-1 view and
// scatter each layer back to the shards before reporting it (a synthetic
// prefill only writes, so its view is not gathered first, and only what
// the chunk wrote goes back). An inner executor that is not chunked takes only whole
// prompts.
func (s *sharded) prefillChunk(ctx context.Context, c Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error) {
	if s.device() {
		// Not chunked (Chunked): a layer is final in device memory only
		// once the whole call stored it back.
		if from != 0 || to != len(tokens) {
			return nil, fmt.Errorf("%w: a TP group in device memory prefills whole prompts only", ErrInvalidOption)
		}
		logits, err := s.PrefillContext(ctx, c, tokens)
		if err != nil {
			return nil, err
		}
		for i := range s.inner.Spec().LayerPattern {
			if err := done(i); err != nil {
				return nil, err
			}
		}
		return logits, nil
	}
	cs := s.caches(c)
	inner, pd, _ := delays(s.inner)
	done = paced(ctx, time.Duration(to-from)*pd, len(inner.Spec().LayerPattern), done)
	if m, ok := inner.(*tiny); ok {
		return m.prefillChunkShards(ctx, cs, tokens, from, to, done)
	}
	ch, ok := inner.(chunker)
	if !ok {
		if from != 0 || to != len(tokens) {
			return nil, fmt.Errorf("%w: %s prefills whole prompts only", ErrInvalidOption, inner.Spec().Name)
		}
		logits, err := PrefillShards(ctx, s.inner, cs, tokens)
		if err != nil {
			return nil, err
		}
		for i := range inner.Spec().LayerPattern {
			if err := done(i); err != nil {
				return nil, err
			}
		}
		return logits, nil
	}
	_, writesOnly := inner.(*synthetic)
	v, err := newTP1View(inner, cs, to, !writesOnly)
	if err != nil {
		return nil, err
	}
	defer v.release()
	parts := partsOf(inner.Spec().LayerPattern)
	last := to == len(tokens)
	return ch.prefillChunk(ctx, v.one, tokens, from, to, func(layer int) error {
		switch p := parts[layer]; p.Kind {
		case '*':
			v.scatterKV(p.KVLayer, from, to)
		case 'M':
			if last || !writesOnly { // a synthetic Mamba layer is written in the last chunk only
				v.scatterMamba(p.MambaLayer)
			}
		}
		return done(layer)
	})
}

func tp1Plans(spec Spec, kv kvcache.Config, tp int) (kvIn, kvOut, mIn, mOut *reshard.Plan, err error) {
	if kv.Layers > 0 {
		if kvIn, err = reshard.New(reshard.KV(kv), tp, 1); err != nil {
			return
		}
		if kvOut, err = reshard.New(reshard.KV(kv), 1, tp); err != nil {
			return
		}
	}
	if spec.Mamba.Layers > 0 {
		if mIn, err = reshard.New(reshard.Mamba(spec.Mamba), tp, 1); err != nil {
			return
		}
		mOut, err = reshard.New(reshard.Mamba(spec.Mamba), 1, tp)
	}
	return
}

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
	h, xn, out []float32
	acc        []acc4
	scores     []float32
	kt         []float32
}

func (m *tiny) newTPScratch() *tpScratch {
	d := &m.d
	return &tpScratch{
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

// ShardPools are the pools of one further shard of a TP group: its arenas
// and their configs (the shard shapes, ShardSpec). With KVMem and MambaMem
// set the pools live in device memory and the arenas are host copies the
// model computes over, moved per call as OnDevice moves shard 0's (wrap
// the group in OnDevice for that one).
type ShardPools struct {
	KVArena    []byte
	KV         kvcache.Config
	MambaArena []byte
	Mamba      mambacache.Config
	KVMem      Memory
	MambaMem   Memory
}

// Sharded returns e over a TP-(1+len(more)) group, as one Executor: the
// Cache of each call is shard 0's, and shards 1.. keep the same request
// (the same blocks and row ids, allocated once for the group) in more.
// Every call runs PrefillShards or DecodeShards. A group size e cannot run
// at is refused (CheckTP). Simulated step times (StepTimer) are not
// forwarded: a TP group is not modelled by the roofline.
func Sharded(e Executor, more []ShardPools) (Executor, error) {
	if err := CheckTP(e, 1+len(more)); err != nil {
		return nil, err
	}
	if len(more) == 0 {
		return e, nil
	}
	return &sharded{inner: e, more: more}, nil
}

type sharded struct {
	inner Executor
	more  []ShardPools
}

var (
	_ ContextExecutor = (*sharded)(nil)
	_ chunker         = (*sharded)(nil)
)

func (s *sharded) Spec() Spec { return s.inner.Spec() }

func (s *sharded) caches(c Cache) []Cache {
	cs := make([]Cache, 1+len(s.more))
	cs[0] = c
	for i, p := range s.more {
		cs[i+1] = Cache{KVArena: p.KVArena, KV: p.KV, Blocks: c.Blocks, MambaArena: p.MambaArena, Mamba: p.Mamba, Row: c.Row}
	}
	return cs
}

func (s *sharded) Prefill(c Cache, tokens []int32) ([]float32, error) {
	return s.PrefillContext(context.Background(), c, tokens)
}

func (s *sharded) Decode(c Cache, token int32, pos int) ([]float32, error) {
	return s.DecodeContext(context.Background(), c, token, pos)
}

func (s *sharded) PrefillContext(ctx context.Context, c Cache, tokens []int32) ([]float32, error) {
	cs := s.caches(c)
	return s.onDevice(cs, len(tokens), func() ([]float32, error) { return PrefillShards(ctx, s.inner, cs, tokens) })
}

func (s *sharded) DecodeContext(ctx context.Context, c Cache, token int32, pos int) ([]float32, error) {
	cs := s.caches(c)
	return s.onDevice(cs, pos+1, func() ([]float32, error) { return DecodeShards(ctx, s.inner, cs, token, pos) })
}

// device reports whether shards 1.. live in device memory.
func (s *sharded) device() bool {
	for _, p := range s.more {
		if p.KVMem != nil || p.MambaMem != nil {
			return true
		}
	}
	return false
}

// onDevice runs call with the request's bytes of shards 1.. (cs[1:], for a
// call over tokens positions) loaded from their device memory, and stores
// them back if it succeeded, as OnDevice does for one cache.
func (s *sharded) onDevice(cs []Cache, tokens int, call func() ([]float32, error)) ([]float32, error) {
	if !s.device() {
		return call()
	}
	var xs []touch
	for i, p := range s.more {
		if p.KVMem == nil || p.MambaMem == nil {
			return nil, fmt.Errorf("%w: shard %d: device memory for one pool of two", ErrInvalidCache, i+1)
		}
		xs = touched(xs, cs[i+1], tokens, p.KVMem, p.MambaMem, fmt.Sprintf("shard %d ", i+1))
	}
	return withDevice(xs, call)
}
