package model_test

import (
	"math/rand/v2"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/model"
)

// Issue 15: every completion of tiny-hybrid is printable text in valid
// UTF-8 (no control characters but newline, no replacement characters),
// whatever the prompt (any bytes), temperature and seed.
func TestTinyTextIsPrintable(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	a := newArenas(t, e.Spec(), 16, 1)
	blocks := make([]kvcache.BlockID, 16)
	for i := range blocks {
		blocks[i] = kvcache.BlockID(i)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for trial := range 12 {
		prompt := make([]int32, 1+r.IntN(40))
		for i := range prompt {
			prompt[i] = int32(r.IntN(256)) // any byte, control and invalid UTF-8 included
		}
		temp := []float64{0, 0.7, 1, 2}[trial%4]
		c := a.cache(0, blocks...)
		logits, err := e.Prefill(c, prompt)
		require.NoError(t, err)
		var out []int32
		for step := range 120 {
			tok := model.Sample(logits, temp, uint64(trial), step)
			if tok == model.EOS {
				break
			}
			require.True(t, tok == '\n' || tok >= 0x20 && tok < 0x7f, "trial %d step %d: token %d", trial, step, tok)
			out = append(out, tok)
			logits, err = e.Decode(c, tok, len(prompt)+step)
			require.NoError(t, err)
		}
		text := model.Decode(out)
		require.True(t, utf8.ValidString(text))
		t.Logf("T=%v %q", temp, text)
	}
}
