package model

import "math"

// textPrior is tiny-hybrid's output bias: the log frequency of each
// character in English text, added to the LM head's logits. Only printable
// ASCII, newline and EOS can be sampled (every other token's bias is -Inf),
// so every completion is printable text in valid UTF-8 that no stream can
// split inside a character, and its letters and spaces come about as often
// as in prose: the output reads like text, not like random bytes. Its
// words are still noise (the weights are random).
func textPrior() []float32 {
	// Frequencies per 10,000 characters of English prose (letters from
	// the usual tables, scaled for spaces and punctuation).
	freq := map[byte]float64{
		' ': 1800, 'e': 1020, 't': 740, 'a': 660, 'o': 610, 'i': 570, 'n': 560, 's': 520, 'h': 490,
		'r': 490, 'd': 350, 'l': 330, 'c': 230, 'u': 225, 'm': 200, 'w': 190, 'f': 180, 'g': 165,
		'y': 160, 'p': 155, 'b': 120, 'v': 80, 'k': 60, 'j': 12, 'x': 12, 'q': 8, 'z': 6,
		',': 95, '.': 90, '\n': 25, '\'': 20, '-': 12, '?': 6, '!': 5, ';': 3, ':': 3, '"': 8,
	}
	prior := make([]float32, ByteVocab)
	for i := range prior {
		prior[i] = float32(math.Inf(-1))
	}
	// The head's logits spread over several units: the prior is weighted
	// so that it shapes the text rather than drowns in them.
	const weight = 1.5
	set := func(tok int32, f float64) { prior[tok] = float32(weight * math.Log(f/10000)) }
	for c, f := range freq {
		set(int32(c), f)
	}
	for c := byte('A'); c <= 'Z'; c++ { // capitals: a tenth of their lowercase
		set(int32(c), freq[c+'a'-'A']/10)
	}
	for c := byte('0'); c <= '9'; c++ {
		set(int32(c), 4)
	}
	for c := byte(0x20); c < 0x7f; c++ { // the rest of printable ASCII: rare
		if math.IsInf(float64(prior[c]), -1) {
			set(int32(c), 1)
		}
	}
	set(EOS, 1) // a completion ends now and then
	return prior
}
