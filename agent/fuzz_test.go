package agent

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"runtime"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
)

func FuzzDecodeRequest(f *testing.F) {
	l := tinyLayout()
	lp := tinyLayout()
	lp.KV.Planes = []Plane{{Offset: 0, Stride: 4096}, {Offset: 2048, Stride: 4096}, {Offset: 1 << 17, Stride: 2048}, {Offset: 1 << 18, Stride: 2048}}
	lp.KV.Order = "nhd"
	lp.Mamba.ConvOrder = "sd"
	lp.Mamba.Planes = []Plane{{Offset: 1 << 18, Stride: 4096}, {Offset: 1 << 19, Stride: 8192}, {Offset: 3 << 18, Stride: 4096}, {Offset: 3 << 19, Stride: 8192}}
	for _, q := range []Request{
		{Op: OpHello, ID: 1, Version: Version},
		{Op: OpRegister, ID: 2, Layout: &l, KVBytes: 1 << 20, MambaBytes: 1 << 16},
		{Op: OpRegister, ID: 2, Layout: &lp, KVBytes: 1 << 20, MambaBytes: 1 << 20},
		{Op: OpGrant, ID: 3, RequestID: 7, Blocks: []int{1, 2}, Row: Row(0), DeadlineMS: 500},
		{Op: OpSendLayer, ID: 4, Send: 1, Kind: "kv", Layer: 3},
	} {
		b, err := msgpack.Marshal(q)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		q, err := decodeRequest(b)
		if err != nil {
			return
		}
		if q.Op == "" {
			t.Fatal("decoded a request without an op")
		}
		if q.Layout != nil {
			compile(*q.Layout, len(q.Buffers) > 0) // must not panic
		}
	})
}

func FuzzReadFrame(f *testing.F) {
	var buf bytes.Buffer
	writeFrame(&buf, Request{Op: OpHello, ID: 1})
	f.Add(buf.Bytes())
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		body, err := readFrame(bytes.NewReader(b))
		if err == nil && len(body) > len(b)-4 {
			t.Fatalf("frame of %d bytes from %d", len(body), len(b))
		}
	})
}

func FuzzDecodeTicket(f *testing.F) {
	rt := rdma.Ticket{Agent: "b#1", Grant: 1, Epoch: 2, RequestID: 7, Extents: []rdma.Extent{{Region: 1, Length: 8}, {Region: 2, Length: 4}}, Bytes: 12}
	planes := rt
	planes.Extents = []rdma.Extent{{Region: 1, Offset: 64, Length: 8}, {Region: 1, Length: 8}, {Region: 2, Offset: 96, Length: 8}, {Region: 2, Offset: 32, Length: 8}, {Region: 3, Length: 4}}
	for _, tc := range []struct {
		v  int
		rt rdma.Ticket
	}{{1, rt}, {ticketPlaneMajor, planes}} {
		for _, tp := range []int{1, 2} {
			shards, subs := []int{0}, []rdma.Ticket{tc.rt}
			if tp == 2 {
				shards, subs = []int{0, 1}, []rdma.Ticket{tc.rt, tc.rt}
			}
			b, err := encodeTicket(ticket{V: tc.v, Agent: "b", Fingerprint: "00", Blocks: 1, Row: true, FromTP: tp, ToTP: 1}, rdma.Descriptor{Agent: "b#1"}, shards, subs, []int{2, 2})
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b, 0)
			f.Add(b, 1)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte, rank int) {
		tk, d, sub, err := decodeTicket(b, rank)
		if err != nil {
			return
		}
		if tk.FromTP < 1 || tk.ToRank >= tk.ToTP || len(tk.Subs) == 0 || (tk.Blocks == 0 && !tk.Row) {
			t.Fatalf("accepted a ticket of TP %d → rank %d of %d, %d grants, %d blocks, row %v", tk.FromTP, tk.ToRank, tk.ToTP, len(tk.Subs), tk.Blocks, tk.Row)
		}
		if sub == nil {
			return
		}
		const most = 64
		rt, err := sub.ticket(most)
		if err != nil {
			return
		}
		if rt.Agent != d.Agent || len(rt.Extents) > most {
			t.Fatalf("accepted a ticket of agent %q with the descriptor of %q, %d extents", rt.Agent, d.Agent, len(rt.Extents))
		}
		if tk.V != ticketFolded && len(sub.Shape) > 0 {
			t.Fatalf("accepted folded extents in a version-%d ticket", tk.V)
		}
		w, _ := toWire(rt, 0)
		again, err := w.ticket(most)
		if err != nil || !reflect.DeepEqual(again.Extents, rt.Extents) {
			t.Fatalf("unfolded %v, unfolded again %v (%v)", rt.Extents, again.Extents, err)
		}
	})
}

func FuzzDecodeOffer(f *testing.F) {
	rt := rdma.Ticket{Agent: "b#1", Grant: 1, RequestID: 7, Extents: []rdma.Extent{{Region: 1, Length: 8}}, Bytes: 8}
	tb, err := encodeTicket(ticket{V: 1, Agent: "b", Blocks: 1, FromTP: 1, ToTP: 1}, rdma.Descriptor{Agent: "b#1"}, []int{0}, []rdma.Ticket{rt}, []int{0})
	if err != nil {
		f.Fatal(err)
	}
	b, err := msgpack.Marshal(offer{From: "b", Ticket: tb})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		o, tk, err := decodeOffer(b)
		if err != nil {
			return
		}
		if _, err := msgpack.Marshal(offer{From: o.From, Ticket: o.Ticket}); err != nil {
			t.Fatal(err)
		}
		_ = tk
	})
}

func FuzzDecodeReply(f *testing.F) {
	for _, r := range []Reply{{Re: 1, Agent: "a", Version: 1}, {Ev: EvGrantDone, Grant: 3, Bytes: 1 << 20}, {Re: 2, Code: "revoked", Msg: "m"}} {
		b, err := msgpack.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeReply(b)
		if err == nil && (r.Re == 0) == (r.Ev == "") {
			t.Fatalf("accepted %+v", r)
		}
	})
}

// TestDecodersRefuseLengthsTheyDoNotHold: a request, a ticket, a reply and
// an offer whose array claims 2^22 elements it does not hold are refused as
// bad input, and without allocating for the claim (msgpack's reflection
// would allocate the slice first: 32 MiB of block numbers, 900 MiB of
// sub-tickets); so is an offer whose ticket holds 2^20 grants, a byte each
// (a 1 MiB message that reflection would turn into 225 MB).
func TestDecodersRefuseLengthsTheyDoNotHold(t *testing.T) {
	huge := binary.BigEndian.AppendUint32([]byte{0xdd}, 1<<22)
	str := func(s string) []byte { return append([]byte{0xa0 | byte(len(s))}, s...) }
	fixmap := func(kv ...[]byte) []byte {
		b := []byte{0x80 | byte(len(kv)/2)}
		for _, x := range kv {
			b = append(b, x...)
		}
		return b
	}
	bin := func(p []byte) []byte {
		return append(binary.BigEndian.AppendUint32([]byte{0xc6}, uint32(len(p))), p...)
	}
	tk := fixmap(str("v"), []byte{0x01}, str("subs"), huge)
	// A ticket that holds what it claims: 2^20 grants, each a nil (one
	// byte), in a 1 MiB offer.
	nils := append(binary.BigEndian.AppendUint32([]byte{0xdd}, 1<<20), bytes.Repeat([]byte{0xc0}, 1<<20)...)
	manyGrants := fixmap(str("from"), str("a"), str("ticket"), bin(fixmap(str("v"), []byte{0x01}, str("subs"), nils)))
	for _, tc := range []struct {
		name   string
		decode func() error
	}{
		{"request", func() error { _, err := decodeRequest(fixmap(str("op"), str("send"), str("blocks"), huge)); return err }},
		{"ticket", func() error { _, _, _, err := decodeTicket(tk, 0); return err }},
		{"reply", func() error { _, err := decodeReply(fixmap(str("re"), []byte{0x01}, str("peers"), huge)); return err }},
		{"offer", func() error {
			_, _, err := decodeOffer(fixmap(str("from"), str("a"), str("ticket"), bin(tk)))
			return err
		}},
		{"offer of a ticket with 2^20 grants", func() error { _, _, err := decodeOffer(manyGrants); return err }},
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		err := tc.decode()
		runtime.ReadMemStats(&after)
		if err == nil {
			t.Errorf("%s: decoded", tc.name)
		}
		if n := after.TotalAlloc - before.TotalAlloc; n > 4<<20 {
			t.Errorf("%s: allocated %d bytes for what it claimed (%v)", tc.name, n, err)
		}
	}
}
