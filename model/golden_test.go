package model_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

// Golden values: peers compare fingerprints, so a change to the tiny model's
// numbers must come with a new Spec.Revision (and new values here).
func TestTinyGolden(t *testing.T) {
	e := lookup(t, model.TinyHybrid)
	a := newArenas(t, e.Spec(), 2, 1)
	c := a.cache(0, 0, 1)
	toks := model.Encode("Hello, hybrid world")
	logits, err := e.Prefill(c, toks)
	require.NoError(t, err)
	var out []int32
	for step := range 8 {
		tok := model.Sample(logits, 0, 0, step)
		out = append(out, tok)
		logits, err = e.Decode(c, tok, len(toks)+step)
		require.NoError(t, err)
	}
	t.Logf("greedy %v, fingerprint %s", out, e.Spec().Fingerprint())
	require.Equal(t, goldenGreedy, out)
	require.Equal(t, goldenFingerprint, e.Spec().Fingerprint())
}

var (
	goldenGreedy      = []int32{102, 101, 32, 117, 101, 32, 117, 32} // "fe ue u "
	goldenFingerprint = "5e4bd599008300b6"
)
