package model

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/handoff-io/handoff/mambacache"
)

// Fingerprint is a stable short hash (16 hex digits of a SHA-256) of everything
// that must match between a prefill and a decode peer: name, revision, layer
// pattern, vocabulary, every KV and Mamba dimension, element sizes, tokens per
// block, the KV block layout and the conv section layout. Pool sizing (blocks, byte budget, batch
// size, attention DP, pipeline size, draft tokens) and MaxContext are not part
// of it, so peers with different pool sizes interoperate.
func (s Spec) Fingerprint() string {
	sum := sha256.Sum256([]byte(s.canonical()))
	return hex.EncodeToString(sum[:8])
}

// canonical is the text Fingerprint hashes; one key=value per line, fixed order.
func (s Spec) canonical() string {
	var b strings.Builder
	w := func(k string, v any) { fmt.Fprintf(&b, "%s=%v\n", k, v) }
	w("fingerprint", "v1")
	w("name", s.Name)
	w("revision", s.Revision)
	w("pattern", s.LayerPattern)
	w("vocab", s.Vocab)
	w("kv.layers", s.KV.Layers)
	w("kv.heads", s.KV.KVHeads)
	w("kv.head_dim", s.KV.HeadDim)
	w("kv.elem", s.KV.ElemSize)
	w("kv.tokens_per_block", s.KV.TokensPerBlock)
	w("kv.layout", "hnd") // heads outermost in a block (kvcache); builds before it wrote tokens outermost
	m := s.Mamba
	w("mamba.layers", m.Layers)
	w("mamba.heads", m.Heads)
	w("mamba.head_dim", m.HeadDim)
	w("mamba.d_state", m.DState)
	w("mamba.n_groups", m.NGroups)
	w("mamba.d_conv", m.DConv)
	w("mamba.conv_elem", m.ConvElemSize)
	w("mamba.ssm_elem", m.SSMElemSize)
	x, bb, c := convSections(m)
	w("mamba.conv_layout", fmt.Sprintf("%s[%d|%d|%d]", layoutName(m.ConvLayout), x, bb, c))
	return b.String()
}

func layoutName(l mambacache.ConvLayout) string {
	switch l {
	case mambacache.ConvXBC:
		return "xbc"
	case mambacache.ConvQKV:
		return "qkv"
	default:
		return fmt.Sprintf("layout%d", l)
	}
}

// convSections returns the channel widths of the three conv sections in
// storage order (SectionX, SectionB, SectionC).
func convSections(m mambacache.Config) (int, int, int) {
	dInner := m.Heads * m.HeadDim
	gs := m.NGroups * m.DState
	if m.ConvLayout == mambacache.ConvQKV {
		return gs, gs, dInner
	}
	return dInner, gs, gs
}
