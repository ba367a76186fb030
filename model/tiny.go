package model

import (
	"context"
	"math"
	"strings"
	"sync"

	"fmt"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
)

// TinyHybrid is the name of the reference model.
const TinyHybrid = "tiny-hybrid"

// tinyDims are the reference model's dimensions.
type tinyDims struct {
	pattern    string
	dModel     int
	mHeads     int // Mamba heads
	mHeadDim   int
	dState     int
	nGroups    int
	dConv      int
	qHeads     int
	kvHeads    int
	headDim    int
	mlpHidden  int
	maxContext int
	tpb        int
	seed       uint64
}

var tinyHybridDims = tinyDims{
	pattern:    "M*M-M*-",
	dModel:     64,
	mHeads:     4,
	mHeadDim:   16,
	dState:     16,
	nGroups:    2,
	dConv:      4,
	qHeads:     4,
	kvHeads:    2,
	headDim:    16,
	mlpHidden:  128,
	maxContext: 4096,
	tpb:        16,
	seed:       0x68616e646f666631, // "handoff1"
}

type tinyLayer struct {
	kind byte
	norm []float32
	// Mamba2
	inProj  []float32 // [dInner + convDim + heads][dModel]: z | x B C | dt
	convW   []float32 // [convDim][dConv], last tap multiplies the current input
	convB   []float32 // [convDim]
	dtBias  []float32 // [heads]
	a       []float32 // [heads], negative: -exp(A_log)
	d       []float32 // [heads]
	outProj []float32 // [dModel][dInner]
	// attention
	wq, wk, wv, wo []float32
	// MLP (SwiGLU)
	up, gate, down []float32
}

// tiny is a small hybrid model with real math: Mamba2 layers whose conv and
// SSM states live in the request's Mamba row, GQA attention layers with
// rotary positions whose K/V live in the request's KV blocks, SwiGLU MLPs,
// RMSNorm and an LM head. All state is float32
// little-endian in the pools. Prefill is Decode run position by position, so
// both produce bit-identical logits and pool bytes.
type tiny struct {
	spec   Spec
	d      tinyDims
	dInner int
	conv   int // conv_dim
	embed  []float32
	head   []float32 // LM head [vocab][dModel]
	prior  []float32 // output bias [vocab] (textPrior)
	final  []float32
	layers []tinyLayer
	cos    []float32 // [maxContext][headDim/2]
	sin    []float32
	mtp    *tinyMTP  // the draft head (DraftLayer), or nil
	pool   sync.Pool // *tinyScratch
}

type tinyScratch struct {
	h, xn, out []float32
	proj       []float32
	conv       []float32
	y          []float32
	q, k, v    []float32
	att        []float32
	scores     []float32
	kt         []float32 // one K or V head read back from the pool
	kBase      []int64
	vBase      []int64
	up, gate   []float32
	row        rowView
	mtp        *mtpScratch // with a draft head
}

func newTinyHybrid(o Options) (Executor, error) {
	if o.SSMElemSize != 0 && o.SSMElemSize != 4 {
		return nil, fmt.Errorf("%w: %s keeps its SSM state in fp32", ErrInvalidOption, TinyHybrid)
	}
	if o.DecodeTouch != 0 {
		return nil, fmt.Errorf("%w: %s computes on its whole state; touch is for the synthetic presets", ErrInvalidOption, TinyHybrid)
	}
	if o.MTP {
		return tinyHybridMTP(), nil
	}
	return tinyHybrid(), nil
}

// tinyHybrid is built once: the executor is immutable and safe to share.
var (
	tinyHybrid    = sync.OnceValue(func() *tiny { return newTiny(TinyHybrid, tinyHybridDims, false) })
	tinyHybridMTP = sync.OnceValue(func() *tiny { return newTiny(TinyHybrid, tinyHybridDims, true) })
)

// newTiny builds the model of dimensions d, with a draft head (DraftLayer)
// when mtp is set. The draft head's weights come from their own stream, so
// the target's are the same either way.
func newTiny(name string, d tinyDims, mtp bool) *tiny {
	m := &tiny{d: d, dInner: d.mHeads * d.mHeadDim}
	m.conv = m.dInner + 2*d.nGroups*d.dState
	m.spec = Spec{
		Name:         name,
		Revision:     "2", // 2: the text prior on the logits
		LayerPattern: d.pattern,
		Vocab:        ByteVocab,
		MaxContext:   d.maxContext,
		KV: kvcache.Config{
			Layers:         strings.Count(d.pattern, "*"),
			KVHeads:        d.kvHeads,
			HeadDim:        d.headDim,
			ElemSize:       4,
			TokensPerBlock: d.tpb,
		},
		Mamba: mambacache.Config{
			Layers:       strings.Count(d.pattern, "M"),
			DState:       d.dState,
			DConv:        d.dConv,
			Heads:        d.mHeads,
			HeadDim:      d.mHeadDim,
			NGroups:      d.nGroups,
			ConvElemSize: 4,
			SSMElemSize:  4,
			ConvLayout:   mambacache.ConvXBC,
		},
	}
	rng := splitmix64(d.seed)
	fill := func(n int, a float64) []float32 {
		w := make([]float32, n)
		for i := range w {
			w[i] = rng.uniform(a)
		}
		return w
	}
	scaled := func(rows, cols int, gain float64) []float32 {
		return fill(rows*cols, gain*math.Sqrt(3/float64(cols)))
	}
	norm := func() []float32 {
		w := fill(d.dModel, 0.1)
		for i := range w {
			w[i]++
		}
		return w
	}
	m.embed = fill(ByteVocab*d.dModel, 1)
	for _, kind := range []byte(d.pattern) {
		l := tinyLayer{kind: kind, norm: norm()}
		switch kind {
		case 'M':
			l.inProj = scaled(m.dInner+m.conv+d.mHeads, d.dModel, 1)
			l.convW = scaled(m.conv, d.dConv, 1)
			l.convB = fill(m.conv, 0.1)
			l.dtBias = make([]float32, d.mHeads)
			l.a = make([]float32, d.mHeads)
			l.d = make([]float32, d.mHeads)
			for h := range d.mHeads {
				// dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt).
				u := float64(rng.next()>>11) * 0x1p-53
				dt := math.Exp2(math.Log2(1e-3) + u*(math.Log2(1e-1)-math.Log2(1e-3)))
				l.dtBias[h] = float32(dt + math.Log(-math.Expm1(-dt)))
				l.a[h] = -float32(1 + 15*float64(rng.next()>>11)*0x1p-53)
				l.d[h] = 1
			}
			l.outProj = scaled(d.dModel, m.dInner, 0.5)
		case '*':
			l.wq = scaled(d.qHeads*d.headDim, d.dModel, 1)
			l.wk = scaled(d.kvHeads*d.headDim, d.dModel, 1)
			l.wv = scaled(d.kvHeads*d.headDim, d.dModel, 1)
			l.wo = scaled(d.dModel, d.qHeads*d.headDim, 0.5)
		case '-':
			l.up = scaled(d.mlpHidden, d.dModel, 1)
			l.gate = scaled(d.mlpHidden, d.dModel, 1)
			l.down = scaled(d.dModel, d.mlpHidden, 0.5)
		default:
			panic("model: bad layer kind " + string(kind))
		}
		m.layers = append(m.layers, l)
	}
	m.final = norm()
	m.head = scaled(ByteVocab, d.dModel, 2)
	m.prior = textPrior()
	if mtp {
		m.mtp = &tinyMTP{kvLayer: m.spec.KV.Layers, ctxLayer: m.spec.KV.Layers - 1}
		for i := range m.layers {
			switch m.layers[i].kind {
			case '*':
				m.mtp.attn = &m.layers[i]
			case '-':
				m.mtp.mlp = &m.layers[i]
			}
		}
		rng = splitmix64(d.seed ^ 0x6d7470)                     // "mtp"
		m.mtp.proj = scaled(d.dModel, d.kvHeads*d.headDim, 0.1) // a small nudge: random weights there only add noise
		m.spec = withDraftLayer(m.spec)
	}
	half := d.headDim / 2
	m.cos = make([]float32, d.maxContext*half)
	m.sin = make([]float32, d.maxContext*half)
	for p := range d.maxContext {
		for i := range half {
			ang := float64(p) * math.Exp2(-float64(2*i)/float64(d.headDim)*math.Log2(10000))
			m.cos[p*half+i] = float32(math.Cos(ang))
			m.sin[p*half+i] = float32(math.Sin(ang))
		}
	}
	m.pool.New = func() any {
		var ms *mtpScratch
		if m.mtp != nil {
			ms = m.newMTPScratch(0)
		}
		return &tinyScratch{
			mtp:    ms,
			h:      make([]float32, d.dModel),
			xn:     make([]float32, d.dModel),
			out:    make([]float32, d.dModel),
			proj:   make([]float32, m.dInner+m.conv+d.mHeads),
			conv:   make([]float32, m.conv),
			y:      make([]float32, m.dInner),
			q:      make([]float32, d.qHeads*d.headDim),
			k:      make([]float32, d.kvHeads*d.headDim),
			v:      make([]float32, d.kvHeads*d.headDim),
			att:    make([]float32, d.qHeads*d.headDim),
			scores: make([]float32, d.qHeads*d.maxContext),
			kt:     make([]float32, d.headDim),
			kBase:  make([]int64, d.maxContext),
			vBase:  make([]int64, d.maxContext),
			up:     make([]float32, d.mlpHidden),
			gate:   make([]float32, d.mlpHidden),
		}
	}
	return m
}

func (m *tiny) Spec() Spec { return m.spec }

func (m *tiny) Prefill(c Cache, tokens []int32) ([]float32, error) {
	if err := checkPrompt(&m.spec, tokens); err != nil {
		return nil, err
	}
	s := m.pool.Get().(*tinyScratch)
	defer m.pool.Put(s)
	if err := checkCache(&m.spec, &c, len(tokens), &s.row); err != nil {
		return nil, err
	}
	logits := make([]float32, m.spec.Vocab)
	last := len(tokens) - 1
	for pos, t := range tokens {
		if pos == last {
			m.step(&c, s, t, pos, logits)
		} else {
			m.step(&c, s, t, pos, nil)
		}
	}
	return logits, nil
}

var _ chunker = (*tiny)(nil)

// prefillChunk is Prefill reordered: every position of the chunk passes
// layer i before any passes layer i+1. Each (layer, position) computes
// exactly what step computes (a layer at position p reads only the lower
// layers' output at p and its own state from positions before p, written
// earlier in the same layer's pass), so cache bytes and logits are
// bit-identical to Prefill's.
func (m *tiny) prefillChunk(ctx context.Context, c Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error) {
	s := m.pool.Get().(*tinyScratch)
	defer m.pool.Put(s)
	if err := checkCache(&m.spec, &c, to, &s.row); err != nil {
		return nil, err
	}
	dm := m.d.dModel
	hs := make([]float32, (to-from)*dm) // the chunk's hidden states
	for p := from; p < to; p++ {
		copy(hs[(p-from)*dm:(p-from+1)*dm], m.embed[int(tokens[p])*dm:(int(tokens[p])+1)*dm])
	}
	if from == 0 {
		s.row.zero()
	}
	mi, ai := 0, 0
	for i := range m.layers {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("model: prefill: %w", err)
		}
		l := &m.layers[i]
		for p := from; p < to; p++ {
			h := hs[(p-from)*dm : (p-from+1)*dm]
			rmsNorm(s.xn, h, l.norm)
			switch l.kind {
			case 'M':
				m.mamba(l, s.row.conv[mi], s.row.ssm[mi], s)
			case '*':
				m.attention(l, ai, &c, p, s)
			case '-':
				m.mlp(l, s)
			}
			addTo(h, s.out)
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
		io := s.mtp.one(c, m.d.kvHeads)
		for p := from; p < to; p++ {
			m.mtpEntry(io, s.mtp, tokens[p], p)
		}
		if err := done(len(m.layers)); err != nil {
			return nil, err
		}
	}
	if to != len(tokens) {
		return nil, nil
	}
	logits := make([]float32, m.spec.Vocab)
	rmsNorm(s.xn, hs[(to-1-from)*dm:(to-from)*dm], m.final)
	for v := range logits {
		logits[v] = dot(m.head[v*dm:(v+1)*dm], s.xn) + m.prior[v]
	}
	return logits, nil
}

func (m *tiny) Decode(c Cache, token int32, pos int) ([]float32, error) {
	if err := checkToken(&m.spec, token); err != nil {
		return nil, err
	}
	if err := checkPos(&m.spec, pos); err != nil {
		return nil, err
	}
	s := m.pool.Get().(*tinyScratch)
	defer m.pool.Put(s)
	if err := checkCache(&m.spec, &c, pos+1, &s.row); err != nil {
		return nil, err
	}
	logits := make([]float32, m.spec.Vocab)
	m.step(&c, s, token, pos, logits)
	return logits, nil
}

// step runs one token through every layer, reading and writing the cache, and
// fills logits when it is not nil. The cache has been validated for pos+1
// tokens and s.row is bound to it.
func (m *tiny) step(c *Cache, s *tinyScratch, token int32, pos int, logits []float32) {
	if pos == 0 {
		s.row.zero()
	}
	dm := m.d.dModel
	copy(s.h, m.embed[int(token)*dm:(int(token)+1)*dm])
	mi, ai := 0, 0
	for i := range m.layers {
		l := &m.layers[i]
		rmsNorm(s.xn, s.h, l.norm)
		switch l.kind {
		case 'M':
			m.mamba(l, s.row.conv[mi], s.row.ssm[mi], s)
			mi++
		case '*':
			m.attention(l, ai, c, pos, s)
			ai++
		case '-':
			m.mlp(l, s)
		}
		addTo(s.h, s.out)
	}
	if m.mtp != nil {
		m.mtpEntry(s.mtp.one(*c, m.d.kvHeads), s.mtp, token, pos)
	}
	if logits == nil {
		return
	}
	rmsNorm(s.xn, s.h, m.final)
	for v := range logits {
		logits[v] = dot(m.head[v*dm:(v+1)*dm], s.xn) + m.prior[v]
	}
}

// mamba is one Mamba2 step: in-projection to z | x B C | dt, causal depthwise
// conv over x|B|C with the window's older d_conv-1 inputs kept in the conv
// state, then per head h = exp(dt*A)*h + dt*B*x, y = C.h + D*x, gated by
// silu(z), and the out-projection.
func (m *tiny) mamba(l *tinyLayer, conv [3][]byte, ssm []byte, s *tinyScratch) {
	d := &m.d
	matVec(s.proj, l.inProj, s.xn)
	z := s.proj[:m.dInner]
	xbc := s.proj[m.dInner : m.dInner+m.conv]
	dtRaw := s.proj[m.dInner+m.conv:]
	km1 := d.dConv - 1
	ch := 0
	for _, st := range conv {
		n := len(st) / (4 * km1)
		for j := 0; j < n; j, ch = j+1, ch+1 {
			w := l.convW[ch*d.dConv : (ch+1)*d.dConv]
			base := j * km1
			acc := l.convB[ch]
			for t := range km1 {
				acc += float32(w[t] * f32At(st, base+t))
			}
			acc += float32(w[km1] * xbc[ch])
			for t := 0; t < km1-1; t++ {
				putF32(st, base+t, f32At(st, base+t+1))
			}
			putF32(st, base+km1-1, xbc[ch])
			s.conv[ch] = silu(acc)
		}
	}
	gs := d.nGroups * d.dState
	x := s.conv[:m.dInner]
	bs := s.conv[m.dInner : m.dInner+gs]
	cs := s.conv[m.dInner+gs:]
	perGroup := d.mHeads / d.nGroups
	n := d.dState
	for h := range d.mHeads {
		dt := softplus(dtRaw[h] + l.dtBias[h])
		dA := exp32(float32(dt * l.a[h]))
		g := h / perGroup
		bg, cg := bs[g*n:(g+1)*n], cs[g*n:(g+1)*n]
		for p := range d.mHeadDim {
			i := h*d.mHeadDim + p
			xv := x[i]
			dtx := float32(dt * xv)
			row := ssm[i*n*4 : (i+1)*n*4]
			var acc float32
			for k := range n {
				v := float32(dA*f32At(row, k)) + float32(dtx*bg[k])
				putF32(row, k, v)
				acc += float32(cg[k] * v)
			}
			s.y[i] = (acc + float32(l.d[h]*xv)) * silu(z[i])
		}
	}
	matVec(s.out, l.outProj, s.y)
}

// attention is one GQA step: project q, k, v, rotate q and k by the position,
// write k and v into the request's block for pos, then attend over positions
// [0, pos] read back from the KV pool.
func (m *tiny) attention(l *tinyLayer, layer int, c *Cache, pos int, s *tinyScratch) {
	d := &m.d
	hd := d.headDim
	matVec(s.q, l.wq, s.xn)
	matVec(s.k, l.wk, s.xn)
	matVec(s.v, l.wv, s.xn)
	for h := range d.qHeads {
		m.rotate(s.q[h*hd:(h+1)*hd], pos)
	}
	for h := range d.kvHeads {
		m.rotate(s.k[h*hd:(h+1)*hd], pos)
	}
	tpb := c.KV.TokensPerBlock
	blk, slot := c.Blocks[pos/tpb], pos%tpb
	for h := range d.kvHeads {
		putF32s(c.KVArena[c.KV.TokenOffset(blk, layer, kvcache.K, slot, h):], s.k[h*hd:(h+1)*hd])
		putF32s(c.KVArena[c.KV.TokenOffset(blk, layer, kvcache.V, slot, h):], s.v[h*hd:(h+1)*hd])
	}
	scale := float32(1 / math.Sqrt(float64(hd)))
	group := d.qHeads / d.kvHeads
	n := pos + 1
	// Per block of the request, where head 0 of slot 0 of K and V start, and the
	// distances between slots and between heads: one TokenOffset per block
	// instead of per token.
	nb := (n + tpb - 1) / tpb
	kBase, vBase := s.kBase[:nb], s.vBase[:nb]
	for i := range nb {
		kBase[i] = c.KV.TokenOffset(c.Blocks[i], layer, kvcache.K, 0, 0)
		vBase[i] = c.KV.TokenOffset(c.Blocks[i], layer, kvcache.V, 0, 0)
	}
	var slotStride int64
	if tpb > 1 {
		slotStride = c.KV.TokenOffset(c.Blocks[0], layer, kvcache.K, 1, 0) - kBase[0]
	}
	var headStride int64
	if d.kvHeads > 1 {
		headStride = c.KV.TokenOffset(c.Blocks[0], layer, kvcache.K, 0, 1) - kBase[0]
	}
	kt := s.kt[:hd]
	for kh := range d.kvHeads {
		// The q heads of this kv head's group share each K/V row read.
		q0 := kh * group
		hOff := int64(kh) * headStride
		for t := range n {
			loadF32s(kt, c.KVArena[kBase[t/tpb]+int64(t%tpb)*slotStride+hOff:])
			for g := range group {
				qh := q0 + g
				s.scores[qh*n+t] = float32(dot(s.q[qh*hd:(qh+1)*hd], kt) * scale)
			}
		}
		for g := range group {
			scores := s.scores[(q0+g)*n : (q0+g+1)*n]
			softmax(scores)
			clear(s.att[(q0+g)*hd : (q0+g+1)*hd])
		}
		for t := range n {
			loadF32s(kt, c.KVArena[vBase[t/tpb]+int64(t%tpb)*slotStride+hOff:])
			for g := range group {
				qh := q0 + g
				axpy(s.att[qh*hd:(qh+1)*hd], s.scores[qh*n+t], kt)
			}
		}
	}
	matVec(s.out, l.wo, s.att)
}

// rotate applies rotary embedding (rotate-half form) to one head.
func (m *tiny) rotate(x []float32, pos int) {
	half := len(x) / 2
	cos := m.cos[pos*half : (pos+1)*half]
	sin := m.sin[pos*half : (pos+1)*half]
	for i := range half {
		a, b := x[i], x[i+half]
		x[i] = float32(a*cos[i]) - float32(b*sin[i])
		x[i+half] = float32(b*cos[i]) + float32(a*sin[i])
	}
}

func (m *tiny) mlp(l *tinyLayer, s *tinyScratch) {
	matVec(s.up, l.up, s.xn)
	matVec(s.gate, l.gate, s.xn)
	for i := range s.up {
		s.up[i] = float32(silu(s.gate[i]) * s.up[i])
	}
	matVec(s.out, l.down, s.up)
}
