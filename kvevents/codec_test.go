package kvevents

import (
	"bytes"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func sampleBatch() *Batch {
	return &Batch{
		TS: 1796536540.5, Rank: 1, Seq: 42, Instance: "prefill-a", Root: Hash{9},
		Events: []Event{
			{Kind: AllBlocksCleared},
			{Kind: BlockStored, Hashes: []Hash{{1}, {2}}, Tokens: []int32{1, 2, 3, 4, 5, 6, 7, 8}, BlockSize: 4, Medium: MediumGPU},
			{Kind: BlockStored, Hashes: []Hash{{3}}, Parent: Hash{2}, HasParent: true, Tokens: []int32{9, 10, 11, 12}, BlockSize: 4, Medium: MediumGPU},
			{Kind: BlockRemoved, Hashes: []Hash{{1}}, Medium: MediumGPU},
			{Kind: StateStored, PrefixHash: Hash{4}, Parent: Hash{3}, HasParent: true, Tokens: []int32{13}, NumTokens: 13, Medium: MediumGPU},
			{Kind: StateRemoved, PrefixHash: Hash{3}, Parent: Hash{3}, HasParent: true, Tokens: []int32{}, NumTokens: 12, Medium: MediumGPU},
		},
	}
}

func TestCodecRoundTrip(t *testing.T) {
	b := sampleBatch()
	data, err := Encode(b)
	require.NoError(t, err)
	got, err := Decode(data)
	require.NoError(t, err)
	require.Equal(t, *b, got)
}

// TestCodecIsVLLMShaped: a consumer of vLLM's format, which knows only
// [ts, events, data_parallel_rank] and its event fields by position,
// finds them where it looks.
func TestCodecIsVLLMShaped(t *testing.T) {
	data, err := Encode(sampleBatch())
	require.NoError(t, err)
	var generic []any
	require.NoError(t, msgpack.Unmarshal(data, &generic))
	require.InDelta(t, 1796536540.5, generic[0], 0)
	require.EqualValues(t, 1, generic[2], "data_parallel_rank")
	events := generic[1].([]any)
	stored := events[1].([]any)
	require.Equal(t, "BlockStored", stored[0])
	require.Len(t, stored[1], 2, "block_hashes")
	require.Equal(t, []byte{1}, stored[1].([]any)[0].([]byte)[:1])
	require.Nil(t, stored[2], "a first block has no parent")
	require.Len(t, stored[3], 8, "token_ids")
	require.EqualValues(t, 4, stored[4], "block_size")
	require.Nil(t, stored[5], "lora_id")
	require.Equal(t, "GPU", stored[6], "medium")
	require.EqualValues(t, GroupKV, stored[9], "group_idx")
	require.Equal(t, KindAttention, stored[10])
	removed := events[3].([]any)
	require.Equal(t, []any{"BlockRemoved", removed[1], "GPU", int8(0)}, removed)
	state := events[4].([]any)
	require.Equal(t, "StateStored", state[0])
	require.Equal(t, KindMamba, state[6])
}

func TestDecodeRefuses(t *testing.T) {
	enc := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		return b
	}
	good, err := Encode(sampleBatch())
	require.NoError(t, err)
	h := make([]byte, 32)
	// A batch whose eighth field, one a later revision might add, nests a
	// million arrays: msgpack's Skip would recurse a million times.
	deep := enc([]any{1.0, []any{}, 0, 1, "p", h, false})
	require.Equal(t, byte(0x97), deep[0]) // an array of seven
	deep[0] = 0x98
	deep = append(append(deep, bytes.Repeat([]byte{0x91}, 1<<20)...), 0x01)
	for name, data := range map[string][]byte{
		"empty":             nil,
		"not an array":      enc(map[string]int{"a": 1}),
		"too short":         enc([]any{1.0, []any{}, 0}),
		"truncated":         good[:len(good)-3],
		"trailing bytes":    append(append([]byte(nil), good...), 0xc0),
		"seq zero":          enc([]any{1.0, []any{}, 0, 0, "p", h, false}),
		"negative rank":     enc([]any{1.0, []any{}, -1, 1, "p", h, false}),
		"short root":        enc([]any{1.0, []any{}, 0, 1, "p", h[:31], false}),
		"short hash":        enc([]any{1.0, []any{[]any{"BlockRemoved", []any{h[:8]}, "GPU", 0}}, 0, 1, "p", h, false}),
		"tokens for blocks": enc([]any{1.0, []any{[]any{"BlockStored", []any{h}, nil, []any{1, 2, 3}, 4, nil, "GPU"}}, 0, 1, "p", h, false}),
		"zero block size":   enc([]any{1.0, []any{[]any{"BlockStored", []any{}, nil, []any{}, 0, nil, "GPU"}}, 0, 1, "p", h, false}),
		"negative token":    enc([]any{1.0, []any{[]any{"BlockStored", []any{h}, nil, []any{1, 2, 3, -4}, 4, nil, "GPU"}}, 0, 1, "p", h, false}),
		"state partial":     enc([]any{1.0, []any{[]any{"StateStored", h, h, []any{1, 2}, 1}}, 0, 1, "p", h, false}),
		"event not array":   enc([]any{1.0, []any{"BlockStored"}, 0, 1, "p", h, false}),
		"tag not string":    enc([]any{1.0, []any{[]any{7}}, 0, 1, "p", h, false}),
		"nested too deep":   deep,
	} {
		_, err := Decode(data)
		require.ErrorIs(t, err, ErrBadBatch, name)
	}
}

// TestDecodeSkipsWhatItDoesNotKnow: an event kind of a later revision, and
// fields after the known ones, are skipped, not refused.
func TestDecodeSkipsWhatItDoesNotKnow(t *testing.T) {
	h := make([]byte, 32)
	data, err := msgpack.Marshal([]any{1.0, []any{
		[]any{"SomethingNew", 1, "x"},
		[]any{"BlockRemoved", []any{h}, "CPU", 0, "later"},
	}, 0, 1, "p", h, false, "a later field"})
	require.NoError(t, err)
	b, err := Decode(data)
	require.NoError(t, err)
	require.Equal(t, []Event{{Kind: BlockRemoved, Hashes: []Hash{{}}, Medium: MediumCPU}}, b.Events)
}

// TestDecodeUnknownEventsCostNothing: a batch of events of an unknown kind
// (three bytes each) decodes to no events, so a batch's memory stays in
// proportion to what it names.
func TestDecodeUnknownEventsCostNothing(t *testing.T) {
	ev := []any{"X"}
	events := make([]any, MaxEvents)
	for i := range events {
		events[i] = ev
	}
	data, err := msgpack.Marshal([]any{1.0, events, 0, 1, "p", make([]byte, 32), false})
	require.NoError(t, err)
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	b, err := Decode(data)
	runtime.ReadMemStats(&ms1)
	require.NoError(t, err)
	require.Less(t, ms1.TotalAlloc-ms0.TotalAlloc, uint64(4*len(data)), "bytes allocated to decode a %d-byte batch", len(data))
	require.Zero(t, len(b.Events))
}

// FuzzDecode: Decode never panics, and what it accepts re-encodes to a
// batch it decodes the same.
func FuzzDecode(f *testing.F) {
	good, err := Encode(sampleBatch())
	require.NoError(f, err)
	f.Add(good)
	f.Add(good[:len(good)/2])
	empty, _ := Encode(&Batch{Seq: 1})
	f.Add(empty)
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := Decode(data)
		if err != nil {
			require.ErrorIs(t, err, ErrBadBatch)
			return
		}
		again, err := Encode(&b)
		require.NoError(t, err)
		b2, err := Decode(again)
		require.NoError(t, err)
		require.Equal(t, b, b2)
	})
}
