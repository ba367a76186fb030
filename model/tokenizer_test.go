package model_test

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

func TestTokenizer(t *testing.T) {
	cases := []struct {
		name string
		in   string
		toks []int32
	}{
		{"empty", "", []int32{}},
		{"ascii", "hi!", []int32{'h', 'i', '!'}},
		{"utf8", "é", []int32{0xc3, 0xa9}},
		{"invalid utf8", "\xff\x00", []int32{255, 0}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.toks, model.Encode(tc.in))
			require.Equal(t, tc.in, model.Decode(tc.toks))
		})
	}
	// Specials and out-of-range tokens decode to nothing.
	require.Equal(t, "ab", model.Decode([]int32{model.BOS, 'a', model.EOS, model.PAD, -1, 1 << 20, 'b'}))
	require.Equal(t, 259, model.ByteVocab)
}

func FuzzTokenizer(f *testing.F) {
	for _, s := range []string{"", "hello", "naïve 日本語", "\xff\xfe\x00", "\x80"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		s := string(data)
		toks := model.Encode(s)
		require.Len(t, toks, len(s))
		for _, tok := range toks {
			require.True(t, tok >= 0 && tok < 256)
		}
		require.Equal(t, s, model.Decode(toks))

		// Arbitrary token streams: Decode keeps exactly the byte tokens.
		var want []byte
		var stream []int32
		for i := 0; i+4 <= len(data); i += 4 {
			tok := int32(binary.LittleEndian.Uint32(data[i:]))
			if i%8 == 0 {
				tok %= model.ByteVocab + 2 // mostly bytes and specials
			}
			stream = append(stream, tok)
			if tok >= 0 && tok < 256 {
				want = append(want, byte(tok))
			}
		}
		require.Equal(t, string(want), model.Decode(stream))
	})
}
