package model

// The tokenizer is byte-level and shared by every model: token t < 256 is the
// byte t; the specials follow.
const (
	BOS int32 = 256 // beginning of sequence; never produced by Encode
	EOS int32 = 257 // end of sequence; a sampled EOS ends generation
	PAD int32 = 258 // padding
	// ByteVocab is the vocabulary size of every model: 256 bytes + 3 specials.
	ByteVocab = 259
)

// Encode returns one token per byte of s (no BOS). Decode(Encode(s)) == s for
// every string, valid UTF-8 or not.
func Encode(s string) []int32 {
	toks := make([]int32, len(s))
	for i := 0; i < len(s); i++ {
		toks[i] = int32(s[i])
	}
	return toks
}

// Decode returns the bytes of the byte tokens in toks; specials and tokens
// outside the vocabulary produce nothing. The result may be invalid UTF-8 when
// toks ends inside a multi-byte character: streaming callers should hold
// back an incomplete tail (see utf8.FullRune).
func Decode(toks []int32) string {
	n := 0
	for _, t := range toks {
		if t >= 0 && t < 256 {
			n++
		}
	}
	b := make([]byte, 0, n)
	for _, t := range toks {
		if t >= 0 && t < 256 {
			b = append(b, byte(t))
		}
	}
	return string(b)
}
