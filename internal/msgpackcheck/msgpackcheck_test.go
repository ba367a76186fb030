package msgpackcheck

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// array32 is an array header claiming n elements.
func array32(n uint32) []byte { return binary.BigEndian.AppendUint32([]byte{0xdd}, n) }

// TestCheckShape: values msgpack encodes pass; a value cut short, a length
// claimed past the end (of an array, a map, a string, bytes, an extension)
// and nesting past 32 are refused as bad messages.
func TestCheck(t *testing.T) {
	nest := func(depth int) []byte {
		b := bytes.Repeat([]byte{0x91}, depth) // fixarrays of one element
		return append(b, 0x01)
	}
	mustEncode := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name string
		b    []byte
		ok   bool
	}{
		{"map", mustEncode(map[string]any{"op": "send", "blocks": []int{1, 2, 300000}, "x": 1.5, "t": []byte("abc")}), true},
		{"nested 32", nest(32), true},
		{"nested 33", nest(33), false},
		{"empty", nil, false},
		{"array claims more than it holds", append(array32(1<<28), 0x01), false},
		{"map claims more than it holds", append(binary.BigEndian.AppendUint32([]byte{0xdf}, 1<<27), 0x01, 0x01), false},
		{"string claims more", binary.BigEndian.AppendUint32([]byte{0xdb}, 1<<30), false},
		{"bytes claim more", append(binary.BigEndian.AppendUint32([]byte{0xc6}, 5), 1, 2, 3), false},
		{"extension claims more", append(binary.BigEndian.AppendUint32([]byte{0xc9}, 4), 1, 2), false},
		{"uint64 cut short", []byte{0xcf, 1, 2}, false},
		{"never-used code", []byte{0xc1}, false},
		{"trailing bytes after one value", []byte{0x01, 0x02}, true},
	} {
		err := Check(tc.b)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// TestSizeOfWhatMsgpackEncodes: random values, as msgpack encodes them,
// pass, and Size is their length; cut short by a byte, they fail.
func TestSizeOfWhatMsgpackEncodes(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	var gen func(depth int) any
	gen = func(depth int) any {
		switch k := r.IntN(9); {
		case k == 0 && depth < 6:
			m := map[string]any{}
			for i := range r.IntN(5) {
				m[string(rune('a'+i))] = gen(depth + 1)
			}
			return m
		case k == 1 && depth < 6:
			a := make([]any, r.IntN(20))
			for i := range a {
				a[i] = gen(depth + 1)
			}
			return a
		case k == 2:
			return r.Int64() >> r.IntN(64)
		case k == 3:
			return r.Uint64() >> r.IntN(64)
		case k == 4:
			return r.Float64()
		case k == 5:
			return bytes.Repeat([]byte{7}, r.IntN(70000))
		case k == 6:
			return string(bytes.Repeat([]byte{'s'}, r.IntN(300)))
		case k == 7:
			return r.IntN(2) == 0
		}
		return nil
	}
	for i := range 500 {
		v := gen(0)
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if n, err := Size(append(b, 0x01)); err != nil || n != len(b) {
			t.Fatalf("value %d (%d bytes): size %d, %v", i, len(b), n, err)
		}
		if err := Check(b[:len(b)-1]); err == nil {
			t.Fatalf("value %d cut short by a byte passed", i)
		}
	}
}

// FuzzCheckShape: whatever CheckShape lets through, msgpack can walk
// without running out of bytes.
func FuzzCheck(f *testing.F) {
	f.Add([]byte{0x92, 0x01, 0xa1, 'x'})
	f.Add(append(array32(1<<28), 0x01))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := Size(b)
		if err != nil {
			return
		}
		r := bytes.NewReader(b)
		if err := msgpack.NewDecoder(r).Skip(); err != nil {
			t.Fatalf("passed Check, but msgpack cannot walk it: %v", err)
		}
		if used := len(b) - r.Len(); used != n {
			t.Fatalf("Size %d, msgpack walked %d bytes", n, used)
		}
	})
}
