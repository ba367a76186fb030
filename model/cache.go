package model

import (
	"fmt"

	"github.com/handoff-io/handoff/mambacache"
)

// rowView is a request's Mamba row cut into per-layer slices of the arena:
// conv[l][s] is section s of layer l's conv state, ssm[l] its SSM state.
type rowView struct {
	conv [][3][]byte
	ssm  [][]byte
}

// checkCache validates c against spec for a request that will hold `tokens`
// positions, and binds the Mamba row into rv (reusing its slices).
func checkCache(spec *Spec, c *Cache, tokens int, rv *rowView) error {
	if err := checkKV(spec, c, tokens); err != nil {
		return err
	}
	return bindRow(spec, c, rv)
}

func checkKV(spec *Spec, c *Cache, tokens int) error {
	want, got := spec.KV, c.KV
	if got.Layers != want.Layers || got.KVHeads != want.KVHeads || got.HeadDim != want.HeadDim || got.ElemSize != want.ElemSize {
		return fmt.Errorf("%w: kv shape layers=%d heads=%d head_dim=%d elem=%d, %s wants %d/%d/%d/%d",
			ErrInvalidCache, got.Layers, got.KVHeads, got.HeadDim, got.ElemSize,
			spec.Name, want.Layers, want.KVHeads, want.HeadDim, want.ElemSize)
	}
	if want.Layers == 0 {
		return nil
	}
	if err := got.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidCache, err)
	}
	if arena := got.ArenaBytes(); int64(len(c.KVArena)) < arena {
		return fmt.Errorf("%w: kv arena of %d bytes, the pool needs %d", ErrInvalidCache, len(c.KVArena), arena)
	}
	need := got.BlocksFor(tokens)
	if len(c.Blocks) < need {
		return fmt.Errorf("%w: %d blocks hold %d tokens, need %d", ErrInvalidCache, len(c.Blocks), len(c.Blocks)*got.TokensPerBlock, tokens)
	}
	n := got.NumBlocks()
	for _, b := range c.Blocks[:need] {
		if int64(b) >= int64(n) {
			return fmt.Errorf("%w: block %d outside a pool of %d blocks", ErrInvalidCache, b, n)
		}
	}
	return nil
}

func bindRow(spec *Spec, c *Cache, rv *rowView) error {
	want, got := spec.Mamba, c.Mamba
	if got.Layers != want.Layers || got.DState != want.DState || got.DConv != want.DConv ||
		got.Heads != want.Heads || got.HeadDim != want.HeadDim || got.NGroups != want.NGroups ||
		got.ConvElemSize != want.ConvElemSize || got.SSMElemSize != want.SSMElemSize ||
		got.ConvLayout != want.ConvLayout {
		return fmt.Errorf("%w: mamba shape %+v does not match %s", ErrInvalidCache, shapeOf(got), spec.Name)
	}
	rv.conv, rv.ssm = rv.conv[:0], rv.ssm[:0]
	if want.Layers == 0 {
		return nil
	}
	if err := got.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidCache, err)
	}
	if rows := got.TotalRows(); int64(c.Row) >= int64(rows) {
		return fmt.Errorf("%w: row %d outside a pool of %d rows", ErrInvalidCache, c.Row, rows)
	}
	arena := int64(len(c.MambaArena))
	if need := got.ArenaBytes(); arena < need {
		return fmt.Errorf("%w: mamba arena of %d bytes, the pool needs %d", ErrInvalidCache, arena, need)
	}
	slice := func(e mambacache.Extent, length int64, what string, layer int) ([]byte, error) {
		if e.Length != length || e.Offset < 0 || e.Offset+e.Length > arena {
			return nil, fmt.Errorf("%w: row %d layer %d %s extent [%d, +%d), want %d bytes inside the %d-byte mamba arena",
				ErrInvalidCache, c.Row, layer, what, e.Offset, e.Length, length, arena)
		}
		return c.MambaArena[e.Offset : e.Offset+e.Length : e.Offset+e.Length], nil
	}
	km1 := int64(want.DConv - 1)
	x, b, cc := convSections(want)
	widths := [3]int64{int64(x), int64(b), int64(cc)}
	ssmLen := int64(want.Heads*want.HeadDim*want.DState) * int64(want.SSMElemSize)
	for l := range want.Layers {
		var conv [3][]byte
		for s := range 3 {
			p, err := slice(got.ConvExtent(c.Row, l, mambacache.Section(s)), widths[s]*km1*int64(want.ConvElemSize), "conv", l)
			if err != nil {
				return err
			}
			conv[s] = p
		}
		ssm, err := slice(got.SSMExtent(c.Row, l), ssmLen, "ssm", l)
		if err != nil {
			return err
		}
		rv.conv = append(rv.conv, conv)
		rv.ssm = append(rv.ssm, ssm)
	}
	return nil
}

type mambaShape struct {
	Layers, DState, DConv, Heads, HeadDim, NGroups, ConvElem, SSMElem int
	Layout                                                            string
}

func shapeOf(m mambacache.Config) mambaShape {
	return mambaShape{m.Layers, m.DState, m.DConv, m.Heads, m.HeadDim, m.NGroups, m.ConvElemSize, m.SSMElemSize, layoutName(m.ConvLayout)}
}

// zero clears the row's state (a fresh request).
func (rv *rowView) zero() {
	for l := range rv.conv {
		for _, p := range rv.conv[l] {
			clear(p)
		}
		clear(rv.ssm[l])
	}
}

func checkToken(spec *Spec, t int32) error {
	if t < 0 || int(t) >= spec.Vocab {
		return fmt.Errorf("%w: %d outside [0, %d)", ErrInvalidToken, t, spec.Vocab)
	}
	return nil
}

func checkPrompt(spec *Spec, tokens []int32) error {
	if len(tokens) == 0 {
		return ErrEmptyPrompt
	}
	if len(tokens) > spec.MaxContext {
		return fmt.Errorf("%w: %d tokens, %s holds %d", ErrContextTooLong, len(tokens), spec.Name, spec.MaxContext)
	}
	for i, t := range tokens {
		if err := checkToken(spec, t); err != nil {
			return fmt.Errorf("token %d: %w", i, err)
		}
	}
	return nil
}

func checkPos(spec *Spec, pos int) error {
	if pos < 0 || pos >= spec.MaxContext {
		return fmt.Errorf("%w: position %d outside [0, %d)", ErrContextTooLong, pos, spec.MaxContext)
	}
	return nil
}
