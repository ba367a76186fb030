package wire

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
)

func sampleRequest(nTokens, nExtents int) PrefillRequest {
	toks := make(Tokens, nTokens)
	for i := range toks {
		toks[i] = int32(i*7 - 3)
	}
	exts := make([]rdma.Extent, nExtents)
	var sum uint64
	for i := range exts {
		exts[i] = rdma.Extent{Region: rdma.RegionID(1 + i%2), Offset: uint64(i) << 20, Length: 4096}
		sum += 4096
	}
	var kv uint64
	if nExtents > 0 {
		kv = sum - exts[nExtents-1].Length
	}
	return PrefillRequest{
		RequestID: 42, From: "decode-0", Attempt: 1, Fingerprint: "tiny-hybrid:abc123",
		Tokens: toks, Sampling: Sampling{Temperature: 0.7, Seed: 9},
		Deadline: time.Date(2026, 1, 1, 0, 0, 1, 0, time.UTC).UnixNano(),
		Peer: PeerOf(rdma.Descriptor{Agent: "decode-0", Host: "h1", TCPAddr: "127.0.0.1:7000",
			Transports: []rdma.Transport{rdma.TransportInproc, rdma.TransportTCP},
			Regions:    []rdma.RegionDesc{{ID: 1, Name: "kv", Length: 1 << 30}, {ID: 2, Name: "mamba", Length: 1 << 20}}}),
		Ticket: rdma.Ticket{Agent: "decode-0", Grant: 5, Epoch: 3, RequestID: 42,
			Extents: exts, Bytes: sum, Deadline: time.Unix(0, 1)},
		KVBytes: kv, MambaBytes: sum - kv,
	}
}

func sampleReply() PrefillReply {
	return PrefillReply{RequestID: 42, Instance: "prefill-1", FirstToken: 17, PrefillNanos: 1234, WriteNanos: 567,
		Manifest: rdma.Manifest{Bytes: []uint64{4096, 4096, 4096}, CRC: []uint32{1, 2, 3}}}
}

func sampleInstance() Instance {
	return Instance{ID: "prefill-1", Role: RolePrefill, Fingerprint: "fp", Peer: sampleRequest(0, 0).Peer,
		Capacity: Capacity{Ranks: 2, Rows: 16, Blocks: 1024, FreeRows: 3, FreeBlocks: 100, Inflight: 1}, Updated: 99}
}

func TestWireRoundTrip(t *testing.T) {
	req := sampleRequest(1000, 33)
	b, err := EncodePrefillRequest(req, 0)
	require.NoError(t, err)
	got, err := DecodePrefillRequest(b)
	require.NoError(t, err)
	req.V = WireVersion
	require.Equal(t, req, got)
	require.Equal(t, req.Peer, PeerOf(got.Peer.Descriptor()))

	rep := sampleReply()
	b, err = EncodePrefillReply(rep, 0)
	require.NoError(t, err)
	gotRep, err := DecodePrefillReply(b)
	require.NoError(t, err)
	rep.V = WireVersion
	require.Equal(t, rep, gotRep)
	rep.Cached = 96 // the prefix cache's count travels, and only when set
	b2, err := EncodePrefillReply(rep, 0)
	require.NoError(t, err)
	require.Greater(t, len(b2), len(b))
	gotRep, err = DecodePrefillReply(b2)
	require.NoError(t, err)
	require.Equal(t, rep, gotRep)

	c := Cancel{RequestID: 42, Grant: 5, Code: session.CodeTimeout, From: "d1"}
	b, err = EncodeCancel(c)
	require.NoError(t, err)
	gotC, err := DecodeCancel(b)
	require.NoError(t, err)
	c.V = WireVersion
	require.Equal(t, c, gotC)

	inst := sampleInstance()
	b, err = EncodeInstance(inst)
	require.NoError(t, err)
	gotI, err := DecodeInstance(b)
	require.NoError(t, err)
	inst.V = WireVersion
	require.Equal(t, inst, gotI)
}

// TestWirePacked checks that bulk fields travel as byte strings: a request with
// 4096 extents is ~20 bytes per extent, not a msgpack array.
func TestWirePacked(t *testing.T) {
	small, err := EncodePrefillRequest(sampleRequest(0, 1), 0)
	require.NoError(t, err)
	big, err := EncodePrefillRequest(sampleRequest(4096, 4096), 0)
	require.NoError(t, err)
	// Packed payload plus a few bytes of longer headers and wider integers.
	growth := len(big) - len(small)
	require.GreaterOrEqual(t, growth, 4095*extentSize+4096*4)
	require.LessOrEqual(t, growth, 4095*extentSize+4096*4+24)
}

// The hand-written codecs must speak the format reflection produces for the
// same tags: plain* mirror the wire types without their codecs.
type plainSampling struct {
	Temperature float64 `msgpack:"t"`
	Seed        uint64  `msgpack:"s"`
	TopP        float64 `msgpack:"p,omitempty"`
	Logprobs    uint8   `msgpack:"lp,omitempty"`
}

type plainPeer struct {
	Agent      string       `msgpack:"a"`
	Host       string       `msgpack:"h"`
	TCPAddr    string       `msgpack:"tcp"`
	ShmAddr    string       `msgpack:"shm"`
	Transports []string     `msgpack:"tr"`
	Regions    []RegionInfo `msgpack:"r"`

	IPCNamespace string   `msgpack:"ipc,omitempty"`
	CUDADevices  []string `msgpack:"cd,omitempty"`
	UCXAddr      []byte   `msgpack:"ucx,omitempty"`
	Incarnation  uint64   `msgpack:"inc,omitempty"`
}

type plainTicket struct {
	Agent     string  `msgpack:"a"`
	Grant     uint64  `msgpack:"g"`
	Epoch     uint64  `msgpack:"e"`
	Token     []byte  `msgpack:"k"`
	RequestID uint64  `msgpack:"id"`
	Extents   extents `msgpack:"x"`
	Bytes     uint64  `msgpack:"b"`
	Deadline  int64   `msgpack:"dl"`
}

type plainRequest struct {
	V           uint8         `msgpack:"v"`
	RequestID   uint64        `msgpack:"id"`
	From        string        `msgpack:"from"`
	Attempt     uint8         `msgpack:"try"`
	Fingerprint string        `msgpack:"fp"`
	Tokens      Tokens        `msgpack:"tok"`
	Sampling    plainSampling `msgpack:"smp"`
	Deadline    int64         `msgpack:"dl"`
	Peer        plainPeer     `msgpack:"peer"`
	Ticket      plainTicket   `msgpack:"tk"`
	KVBytes     uint64        `msgpack:"kvb"`
	MambaBytes  uint64        `msgpack:"mb"`
	Budget      int64         `msgpack:"rem"`
	TP          uint16        `msgpack:"tp,omitempty"`
	Skip        uint32        `msgpack:"skip,omitempty"`
}

type plainManifest struct {
	Bytes u64s `msgpack:"b"`
	CRC   u32s `msgpack:"c"`
}

type plainReply struct {
	V            uint8         `msgpack:"v"`
	RequestID    uint64        `msgpack:"id"`
	Instance     string        `msgpack:"inst"`
	Code         session.Code  `msgpack:"code"`
	Msg          string        `msgpack:"msg"`
	FirstToken   int32         `msgpack:"tok"`
	PrefillNanos int64         `msgpack:"pf"`
	WriteNanos   int64         `msgpack:"wr"`
	Manifest     plainManifest `msgpack:"man"`
	Logprobs     []byte        `msgpack:"lp,omitempty"`
	Cached       uint32        `msgpack:"cached,omitempty"`
	TooLong      bool          `msgpack:"long,omitempty"`
}

func plainOfRequest(m PrefillRequest) plainRequest {
	return plainRequest{V: m.V, RequestID: m.RequestID, From: m.From, Attempt: m.Attempt, Fingerprint: m.Fingerprint,
		Tokens: m.Tokens, Sampling: plainSampling(m.Sampling), Deadline: m.Deadline, Peer: plainPeer(m.Peer),
		Ticket: plainOfTicket(m.Ticket), KVBytes: m.KVBytes, MambaBytes: m.MambaBytes, Budget: m.Budget, TP: m.TP, Skip: m.Skip}
}

func plainOfReply(m PrefillReply) plainReply {
	return plainReply{V: m.V, RequestID: m.RequestID, Instance: m.Instance, Code: m.Code, Msg: m.Msg,
		FirstToken: m.FirstToken, PrefillNanos: m.PrefillNanos, WriteNanos: m.WriteNanos,
		Manifest: plainManifest{Bytes: m.Manifest.Bytes, CRC: m.Manifest.CRC}, Logprobs: m.Logprobs, Cached: m.Cached, TooLong: m.TooLong}
}

func plainOfTicket(t rdma.Ticket) plainTicket {
	return plainTicket{Agent: string(t.Agent), Grant: t.Grant, Epoch: t.Epoch, Token: t.Token[:], RequestID: t.RequestID,
		Extents: t.Extents, Bytes: t.Bytes, Deadline: unixNano(t.Deadline)}
}

func TestWireHandCodecsMatchReflection(t *testing.T) {
	req := sampleRequest(7, 3)
	req.V, req.TP = WireVersion, 4
	req.Peer.Incarnation = 1<<60 + 5
	b, err := EncodePrefillRequest(req, 0)
	require.NoError(t, err)
	var pr plainRequest
	require.NoError(t, msgpack.Unmarshal(b, &pr))
	require.Equal(t, plainOfRequest(req), pr)
	b, err = msgpack.Marshal(plainOfRequest(req))
	require.NoError(t, err)
	got, err := DecodePrefillRequest(b)
	require.NoError(t, err)
	require.Equal(t, req, got)

	rep := sampleReply()
	rep.V, rep.Code, rep.Msg, rep.TooLong = WireVersion, session.CodeCapacityRefused, "boom", true
	b, err = EncodePrefillReply(rep, 0)
	require.NoError(t, err)
	var pp plainReply
	require.NoError(t, msgpack.Unmarshal(b, &pp))
	require.Equal(t, plainOfReply(rep), pp)
	b, err = msgpack.Marshal(plainOfReply(rep))
	require.NoError(t, err)
	gotRep, err := DecodePrefillReply(b)
	require.NoError(t, err)
	require.Equal(t, rep, gotRep)

	// Nil lists survive both ways as nil.
	req.Peer.Transports, req.Peer.Regions = nil, nil
	b, err = EncodePrefillRequest(req, 0)
	require.NoError(t, err)
	got, err = DecodePrefillRequest(b)
	require.NoError(t, err)
	require.Equal(t, req, got)
}

// The byte-level encoders write exactly the bytes reflection writes with
// compact integers, over the ranges of every integer and string length class.
func TestWireHandCodecsSameBytesAsReflection(t *testing.T) {
	marshal := func(v any) ([]byte, error) {
		var buf bytes.Buffer
		enc := msgpack.NewEncoder(&buf)
		enc.UseCompactInts(true)
		err := enc.Encode(v)
		return buf.Bytes(), err
	}
	ints := []int64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, -1, -32, -33, -128, -129, -32768, -32769, -1 << 31, -1<<31 - 1}
	strs := []string{"", "a", string(make([]byte, 31)), string(make([]byte, 32)), string(make([]byte, 255)), string(make([]byte, 256)), string(make([]byte, 65536))}
	for i, n := range ints {
		req := sampleRequest(i, 1+i%3)
		req.V = WireVersion
		req.RequestID, req.Ticket.RequestID = uint64(n), uint64(n)
		req.Deadline, req.Ticket.Deadline, req.Budget = n, fromUnixNano(-n), n/3
		if i%2 == 1 { // the optional fields, present and absent
			req.Sampling.TopP, req.Sampling.Logprobs = 0.9, uint8(i)
			req.TP = uint16(n)
		}
		req.From = strs[i%len(strs)]
		if i%4 == 0 {
			req.Peer.Transports, req.Peer.Regions, req.Ticket.Extents = nil, nil, nil
		}
		b, err := EncodePrefillRequest(req, 1<<30)
		require.NoError(t, err)
		want, err := marshal(plainOfRequest(req))
		require.NoError(t, err)
		require.Equal(t, want, b, "request %d", n)

		rep := sampleReply()
		rep.V, rep.RequestID, rep.PrefillNanos, rep.FirstToken, rep.Msg = WireVersion, uint64(n), n, int32(n), strs[(i+3)%len(strs)]
		if i%3 == 0 {
			rep.Manifest = rdma.Manifest{}
		}
		if i%2 == 1 {
			rep.Logprobs = []byte(strs[i%len(strs)] + "lp")
		}
		rep.TooLong = i%3 == 1
		b, err = EncodePrefillReply(rep, 1<<30)
		require.NoError(t, err)
		want, err = marshal(plainOfReply(rep))
		require.NoError(t, err)
		require.Equal(t, want, b, "reply %d", n)
	}
}

// A prefill worker's decode takes a peer it decoded before from its cache:
// the same request and descriptor as a plain decode, for any peer.
func TestWirePeerCache(t *testing.T) {
	var c PeerCache
	a, b := sampleRequest(3, 2), sampleRequest(3, 2)
	b.Peer.Agent, b.Peer.Regions = "other", nil
	for i, req := range []PrefillRequest{a, a, b, a, b, b} {
		req.V = WireVersion
		data, err := EncodePrefillRequest(req, 0)
		require.NoError(t, err)
		got, desc, err := decodePrefillRequest(data, &c)
		require.NoError(t, err)
		require.Equal(t, req, got, "request %d", i)
		require.Equal(t, req.Peer.Descriptor(), desc, "request %d", i)
	}
	data, err := EncodePrefillRequest(a, 0)
	require.NoError(t, err)
	_, _, err = decodePrefillRequest(data[:len(data)/2], &c)
	require.ErrorIs(t, err, ErrBadMessage)
}

func TestWireOversize(t *testing.T) {
	// 262144 tokens are exactly 1 MiB packed: with the rest of the message the
	// request exceeds NATS's default max payload.
	req := sampleRequest(DefaultMaxPayload/4, 2)
	_, err := EncodePrefillRequest(req, 0)
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	_, err = EncodePrefillRequest(sampleRequest(1000, 2), 512)
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	_, err = EncodePrefillRequest(sampleRequest(1000, 2), 64<<10)
	require.NoError(t, err)
}

func TestWireRefusesBadMessages(t *testing.T) {
	enc := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		return b
	}
	wrongVersion := sampleRequest(3, 2)
	wrongVersion.V = 2
	badToken := plainOfRequest(sampleRequest(3, 2))
	badToken.V, badToken.Ticket.Token = WireVersion, []byte{1, 2}
	nilToken := plainOfRequest(sampleRequest(3, 2))
	nilToken.V, nilToken.Ticket.Token = WireVersion, nil
	badSum := sampleRequest(3, 2)
	badSum.V, badSum.Ticket.Bytes = WireVersion, 1
	badSplit := sampleRequest(3, 2)
	badSplit.V, badSplit.KVBytes = WireVersion, badSplit.KVBytes+1
	otherID := sampleRequest(3, 2)
	otherID.V, otherID.Ticket.RequestID = WireVersion, 43
	noVersion := sampleRequest(3, 2)
	cases := map[string][]byte{
		"empty":           {},
		"garbage":         []byte("not msgpack at all"),
		"wrong version":   enc(&wrongVersion),
		"no version":      enc(&noVersion),
		"short token":     enc(&badToken),
		"nil token":       enc(&nilToken),
		"no token":        enc(map[string]any{"v": 1, "id": 42, "tk": map[string]any{"id": 42}}),
		"no ticket":       enc(map[string]any{"v": 1}),
		"ticket sum":      enc(&badSum),
		"kv/mamba split":  enc(&badSplit),
		"ticket other id": enc(&otherID),
		"ragged extents":  enc(map[string]any{"v": 1, "tk": map[string]any{"x": make([]byte, 21)}}),
		"ragged tokens":   enc(map[string]any{"v": 1, "tok": make([]byte, 7)}),
		"tokens as array": enc(map[string]any{"v": 1, "tok": []int{1, 2}}),
	}
	for name, b := range cases {
		_, err := DecodePrefillRequest(b)
		require.ErrorIs(t, err, ErrBadMessage, name)
	}
	_, err := DecodePrefillReply(enc(map[string]any{"v": 1, "code": 999}))
	require.ErrorIs(t, err, ErrBadMessage)
	_, err = DecodePrefillReply(enc(map[string]any{"v": 1, "man": map[string]any{"b": make([]byte, 16), "c": make([]byte, 4)}}))
	require.ErrorIs(t, err, ErrBadMessage)
	_, err = DecodeCancel(enc(map[string]any{"v": 1, "code": 999}))
	require.ErrorIs(t, err, ErrBadMessage)
	_, err = DecodeInstance(enc(map[string]any{"v": 1, "id": "x", "role": "router"}))
	require.ErrorIs(t, err, ErrBadMessage)
	_, err = DecodeInstance(enc(map[string]any{"v": 1, "role": "prefill"}))
	require.ErrorIs(t, err, ErrBadMessage)
}

// A message that repeats a key whose value is a struct decodes as msgpack's
// own decoder makes of it (which merges the repeat into the first) or is
// refused; the request goes through the prefill worker's peer cache too.
func TestWireRepeatedStructKeys(t *testing.T) {
	again := func(b []byte, key string, v any) []byte {
		b = append([]byte(nil), b...)
		b[0]++ // one more key in the fixmap
		b = appendStr(b, key)
		tail, err := msgpack.Marshal(v)
		require.NoError(t, err)
		return append(b, tail...)
	}
	req, err := EncodePrefillRequest(sampleRequest(3, 2), 0)
	require.NoError(t, err)
	rep, err := EncodePrefillReply(sampleReply(), 0)
	require.NoError(t, err)
	peer := PeerOf(rdma.Descriptor{Agent: "decode-0", Regions: []rdma.RegionDesc{{ID: 1, Name: "kv", Length: 8}}})
	peerB := peer.appendTo(nil)
	peerB[0]++
	peerB = append(appendStr(peerB, "r"), []byte{0x91, 0x81, 0xa1, 'n', 0xa1, 'x'}...) // r: [{n: "x"}]
	peerAgain := append(appendStr(append([]byte(nil), req...), "peer"), peerB...)
	peerAgain[0]++
	requests := map[string][]byte{
		"smp":  again(req, "smp", map[string]any{"n": 3}),
		"tk":   again(req, "tk", map[string]any{"a": "other"}),
		"peer": again(req, "peer", map[string]any{"h": "other"}),
		"r":    peerAgain,
	}
	for name, b := range requests {
		var p plainRequest
		require.NoError(t, msgpack.Unmarshal(b, &p), name)
		for _, peers := range []*PeerCache{nil, new(PeerCache)} {
			m, _, err := decodePrefillRequest(b, peers)
			if err != nil {
				require.ErrorIs(t, err, ErrBadMessage, name)
				continue
			}
			require.Equal(t, p, plainOfRequest(m), name)
		}
	}
	b := again(rep, "man", map[string]any{"c": []byte{}})
	var p plainReply
	require.NoError(t, msgpack.Unmarshal(b, &p))
	if m, err := DecodePrefillReply(b); err != nil {
		require.ErrorIs(t, err, ErrBadMessage)
	} else {
		require.Equal(t, p, plainOfReply(m))
	}
}

// TestWireIgnoresUnknownKeys: a later minor revision may add fields.
func TestWireIgnoresUnknownKeys(t *testing.T) {
	b, err := msgpack.Marshal(map[string]any{"v": 1, "id": 5, "code": 2, "future": []int{1, 2, 3}})
	require.NoError(t, err)
	c, err := DecodeCancel(b)
	require.NoError(t, err)
	require.Equal(t, Cancel{V: 1, RequestID: 5, Code: session.CodeTimeout}, c)
}

func TestSubjects(t *testing.T) {
	require.Equal(t, "handoff.ns1.prefill", Subject("handoff", "ns1", SubjectPrefill, "x"))
	require.Equal(t, "handoff.ns1.inst.p-1.prefill", Subject("handoff", "ns1", SubjectInstancePrefill, "p-1"))
	require.Equal(t, "handoff.ns1.inst.p-1.cancel", Subject("handoff", "ns1", SubjectInstanceCancel, "p-1"))
	require.Equal(t, "handoff.ns1.cancel", Subject("handoff", "ns1", SubjectCancel, ""))
	require.Equal(t, "handoff.ns1.inst.*.kvevents", Subject("handoff", "ns1", SubjectInstanceEvents, "*"))
	require.Equal(t, "handoff.ns1.inst.p-1.kvevents.sync", Subject("handoff", "ns1", SubjectInstanceEventsSync, "p-1"))
	require.Equal(t, "handoff_ns1", BucketName("handoff", "ns1"))
	require.Panics(t, func() { Subject("handoff", "ns1", SubjectKind(99), "") })
	for s, ok := range map[string]bool{"a": true, "A-z_0": true, "": false, "a.b": false, "a*": false, "a b": false, "é": false} {
		require.Equal(t, ok, ValidToken(s), s)
	}
}

func fuzzSeeds(f *testing.F, msgs ...[]byte) {
	for _, b := range msgs {
		f.Add(b)
		if len(b) > 4 {
			f.Add(b[:len(b)/2]) // truncated
		}
	}
	f.Add([]byte{})
	f.Add([]byte{0x80})
}

func FuzzDecodePrefillRequest(f *testing.F) {
	a, _ := EncodePrefillRequest(sampleRequest(16, 3), 0)
	b, _ := EncodePrefillRequest(sampleRequest(0, 1), 0)
	drafts := sampleRequest(4, 2)
	drafts.Drafts = 4
	c, _ := EncodePrefillRequest(drafts, 0)
	skip := sampleRequest(16, 3)
	skip.Skip = 5
	d, _ := EncodePrefillRequest(skip, 0)
	fuzzSeeds(f, a, b, c, d)
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodePrefillRequest(data)
		if err != nil {
			require.ErrorIs(t, err, ErrBadMessage)
			return
		}
		// A decoded request re-encodes to a request that encodes the same
		// (compared as bytes: a NaN temperature is not equal to itself).
		again, err := EncodePrefillRequest(m, 1<<30)
		require.NoError(t, err)
		m2, err := DecodePrefillRequest(again)
		require.NoError(t, err)
		again2, err := EncodePrefillRequest(m2, 1<<30)
		require.NoError(t, err)
		require.Equal(t, again, again2)
	})
}

// FuzzDecodeMatchesReflection: whatever msgpack's own decoder makes of a
// message, the byte-level decoder makes the same of it, or refuses it.
func FuzzDecodeMatchesReflection(f *testing.F) {
	skip := sampleRequest(16, 3)
	skip.Skip = 2
	d, _ := EncodePrefillRequest(skip, 0)
	f.Add(d)
	a, _ := EncodePrefillRequest(sampleRequest(16, 3), 0)
	b, _ := EncodePrefillReply(sampleReply(), 0)
	cached := sampleReply()
	cached.Cached = 1 << 20
	c, _ := EncodePrefillReply(cached, 0)
	fuzzSeeds(f, a, b, c)
	f.Fuzz(func(t *testing.T, data []byte) {
		if m, err := DecodePrefillRequest(data); err == nil {
			var p plainRequest
			require.NoError(t, msgpack.Unmarshal(data, &p))
			require.Equal(t, plainOfRequest(m), p)
		}
		if m, err := DecodePrefillReply(data); err == nil {
			var p plainReply
			require.NoError(t, msgpack.Unmarshal(data, &p))
			require.Equal(t, plainOfReply(m), p)
		}
	})
}

// FuzzPeerCacheDecode: a prefill worker's cached decode makes of a request
// what the plain one makes of it, whatever it decoded before (the cache
// lives as long as the fuzzing process), and the descriptor of its peer.
func FuzzPeerCacheDecode(f *testing.F) {
	a, _ := EncodePrefillRequest(sampleRequest(16, 3), 0)
	other := sampleRequest(0, 1)
	other.Peer.Agent, other.Peer.Regions = "other", nil
	b, _ := EncodePrefillRequest(other, 0)
	fuzzSeeds(f, a, b)
	var c PeerCache
	f.Fuzz(func(t *testing.T, data []byte) {
		want, err := DecodePrefillRequest(data)
		for range 2 { // a miss, then a hit
			got, desc, cerr := c.DecodePrefillRequest(data)
			if err != nil {
				require.ErrorIs(t, cerr, ErrBadMessage)
				continue
			}
			require.NoError(t, cerr)
			// Compared as bytes: a NaN temperature is not equal to itself.
			wb, err := EncodePrefillRequest(want, 1<<30)
			require.NoError(t, err)
			gb, err := EncodePrefillRequest(got, 1<<30)
			require.NoError(t, err)
			require.Equal(t, wb, gb)
			require.Equal(t, want.Peer.Descriptor(), desc)
		}
	})
}

func FuzzDecodePrefillReply(f *testing.F) {
	a, _ := EncodePrefillReply(sampleReply(), 0)
	b, _ := EncodePrefillReply(PrefillReply{RequestID: 1, Code: session.CodeCapacityRefused, Msg: "full"}, 0)
	cached := sampleReply()
	cached.Cached = 77
	c, _ := EncodePrefillReply(cached, 0)
	drafts := sampleReply()
	drafts.Drafts = Tokens{101, 32, 101, 32}
	d, _ := EncodePrefillReply(drafts, 0)
	drafts.Drafts = Tokens{-1}
	e, _ := EncodePrefillReply(drafts, 0) // refused: a negative token
	drafts.Drafts = make(Tokens, MaxDrafts+1)
	g, _ := EncodePrefillReply(drafts, 0) // refused: too many
	fuzzSeeds(f, a, b, c, d, e, g)
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodePrefillReply(data)
		if err != nil {
			require.ErrorIs(t, err, ErrBadMessage)
			return
		}
		again, err := EncodePrefillReply(m, 1<<30)
		require.NoError(t, err)
		m2, err := DecodePrefillReply(again)
		require.NoError(t, err)
		require.Equal(t, m, m2)
		again2, err := EncodePrefillReply(m2, 1<<30)
		require.NoError(t, err)
		require.Equal(t, again, again2)
	})
}

func FuzzDecodeCancel(f *testing.F) {
	a, _ := EncodeCancel(Cancel{RequestID: 42, Grant: 5, Code: session.CodeTimeout})
	fuzzSeeds(f, a)
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeCancel(data)
		if err != nil {
			require.ErrorIs(t, err, ErrBadMessage)
			return
		}
		again, err := EncodeCancel(m)
		require.NoError(t, err)
		m2, err := DecodeCancel(again)
		require.NoError(t, err)
		require.Equal(t, m, m2)
	})
}

func FuzzDecodeInstance(f *testing.F) {
	a, _ := EncodeInstance(sampleInstance())
	fuzzSeeds(f, a)
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeInstance(data)
		if err != nil {
			require.ErrorIs(t, err, ErrBadMessage)
			return
		}
		again, err := EncodeInstance(m)
		require.NoError(t, err)
		m2, err := DecodeInstance(again)
		require.NoError(t, err)
		require.Equal(t, m, m2)
	})
}

func BenchmarkEncodePrefillRequest(b *testing.B) {
	for _, n := range []int{1, 64, 4096} {
		req := sampleRequest(n, n)
		b.Run(fmt.Sprintf("extents=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := EncodePrefillRequest(req, 1<<30); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkDecodePrefillRequest(b *testing.B) {
	for _, n := range []int{1, 64, 4096} {
		data, err := EncodePrefillRequest(sampleRequest(n, n), 1<<30)
		require.NoError(b, err)
		b.Run(fmt.Sprintf("extents=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(data)))
			for b.Loop() {
				if _, err := DecodePrefillRequest(data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// Integers too wide for their field are refused, not truncated into
// another value: a reply code 65536 is not OK, a version 257 is not 1.
func TestDecodeRefusesTruncation(t *testing.T) {
	msg := func(kv ...any) []byte {
		b := appendMapLen(nil, len(kv)/2)
		for i := 0; i < len(kv); i += 2 {
			b = appendStr(b, kv[i].(string))
			switch v := kv[i+1].(type) {
			case int:
				b = appendUint(b, uint64(v))
			case string:
				b = appendStr(b, v)
			}
		}
		return b
	}
	for _, tc := range []struct {
		name   string
		decode func([]byte) error
		data   []byte
	}{
		{"reply code", func(b []byte) error { _, err := DecodePrefillReply(b); return err },
			msg("v", 1, "id", 7, "inst", "p1", "code", 1<<16)},
		{"reply version", func(b []byte) error { _, err := DecodePrefillReply(b); return err },
			msg("v", 257, "id", 7, "inst", "p1", "code", 0)},
		{"request version", func(b []byte) error { _, err := DecodePrefillRequest(b); return err },
			requestWith(t, "v", 257)},
		{"request attempt", func(b []byte) error { _, err := DecodePrefillRequest(b); return err },
			requestWith(t, "try", 256)},
		{"cancel code", func(b []byte) error { _, err := DecodeCancel(b); return err },
			msg("v", 1, "id", 7, "code", 1<<16+int(session.CodeCancelled))},
		{"cancel version", func(b []byte) error { _, err := DecodeCancel(b); return err },
			msg("v", 257, "id", 7, "code", int(session.CodeCancelled))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorIs(t, tc.decode(tc.data), ErrBadMessage)
		})
	}
	// The same messages in range decode.
	_, err := DecodeCancel(msg("v", 1, "id", 7, "code", int(session.CodeCancelled)))
	require.NoError(t, err)
	_, err = DecodePrefillRequest(requestWith(t, "try", 255))
	require.NoError(t, err)
}

// requestWith is a valid encoded request with key set to v.
func requestWith(t *testing.T, key string, v uint64) []byte {
	t.Helper()
	b, err := EncodePrefillRequest(sampleRequest(16, 3), 0)
	require.NoError(t, err)
	var m map[string]msgpack.RawMessage
	require.NoError(t, msgpack.Unmarshal(b, &m))
	m[key] = appendUint(nil, v)
	out := appendMapLen(nil, len(m))
	for k, raw := range m {
		out = append(appendStr(out, k), raw...)
	}
	return out
}

// TestPeerUCXAddrRoundTrip: a descriptor's UCX worker address survives the
// wire, and one without leaves the bytes as before (omitted).
func TestPeerUCXAddrRoundTrip(t *testing.T) {
	d := rdma.Descriptor{Agent: "decode-0", Host: "h", Transports: []rdma.Transport{rdma.TransportUCX}, UCXAddr: []byte{0, 1, 2, 0xff}}
	b, err := msgpack.Marshal(PeerOf(d))
	require.NoError(t, err)
	var p Peer
	require.NoError(t, msgpack.Unmarshal(b, &p))
	require.Equal(t, d.UCXAddr, p.Descriptor().UCXAddr)
	var plain plainPeer
	require.NoError(t, msgpack.Unmarshal(b, &plain))
	require.Equal(t, d.UCXAddr, plain.UCXAddr)

	d.UCXAddr = nil
	without, err := msgpack.Marshal(PeerOf(d))
	require.NoError(t, err)
	require.NotContains(t, string(without), "ucx\xc4")
}

// TestPeerIncarnationRoundTrip: a descriptor's incarnation survives the
// wire, and one without (0: unknown) leaves the bytes as before.
func TestPeerIncarnationRoundTrip(t *testing.T) {
	d := rdma.Descriptor{Agent: "decode-0", Host: "h", Transports: []rdma.Transport{rdma.TransportTCP}, TCPAddr: "10.0.0.1:7000", Incarnation: 1_765_000_000_123_456_789}
	b, err := msgpack.Marshal(PeerOf(d))
	require.NoError(t, err)
	var p Peer
	require.NoError(t, msgpack.Unmarshal(b, &p))
	require.Equal(t, d, p.Descriptor())

	d.Incarnation = 0
	without, err := msgpack.Marshal(PeerOf(d))
	require.NoError(t, err)
	require.NotContains(t, string(without), "inc")
	require.Less(t, len(without), len(b))
}

// TestPrefillRequestSkip: a delta handoff's skip travels, and a skip of
// every block of the prompt (no last block to send) is refused.
func TestPrefillRequestSkip(t *testing.T) {
	m := sampleRequest(16, 3)
	m.Skip = 3
	b, err := EncodePrefillRequest(m, 0)
	require.NoError(t, err)
	got, err := DecodePrefillRequest(b)
	require.NoError(t, err)
	require.Equal(t, uint32(3), got.Skip)
	var p plainRequest
	require.NoError(t, msgpack.Unmarshal(b, &p))
	require.Equal(t, uint32(3), p.Skip, "the hand codec writes what reflection reads")

	m.Skip = uint32(len(m.Tokens))
	b, err = EncodePrefillRequest(m, 0)
	require.NoError(t, err)
	_, err = DecodePrefillRequest(b)
	require.ErrorIs(t, err, ErrBadMessage)
}

func TestStateOfferRoundTrip(t *testing.T) {
	m := StateOffer{From: "decode-1", Fingerprint: "fp", Tokens: Tokens{1, 2, 3, 0}}
	b, err := EncodeStateOffer(m, 0)
	require.NoError(t, err)
	got, err := DecodeStateOffer(b)
	require.NoError(t, err)
	m.V = WireVersion
	require.Equal(t, m, got)
	require.Equal(t, "handoff.ns1.inst.p-1.state.offer", Subject("handoff", "ns1", SubjectInstanceStateOffer, "p-1"))

	for name, bad := range map[string]StateOffer{
		"no tokens":      {From: "d1"},
		"negative token": {From: "d1", Tokens: Tokens{1, -2}},
		"bad holder":     {From: "d.1", Tokens: Tokens{1}},
		"no holder":      {Tokens: Tokens{1}},
	} {
		b, err := EncodeStateOffer(bad, 0)
		require.NoError(t, err, name)
		_, err = DecodeStateOffer(b)
		require.ErrorIs(t, err, ErrBadMessage, name)
	}
	_, err = EncodeStateOffer(StateOffer{From: "d1", Tokens: make(Tokens, 1000)}, 512)
	require.ErrorIs(t, err, ErrPayloadTooLarge)
}

func FuzzDecodeStateOffer(f *testing.F) {
	a, _ := EncodeStateOffer(StateOffer{From: "d1", Fingerprint: "fp", Tokens: Tokens{5, 6, 7}}, 0)
	fuzzSeeds(f, a)
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeStateOffer(data)
		if err != nil {
			require.ErrorIs(t, err, ErrBadMessage)
			return
		}
		again, err := EncodeStateOffer(m, 1<<30)
		require.NoError(t, err)
		m2, err := DecodeStateOffer(again)
		require.NoError(t, err)
		require.Equal(t, m, m2)
	})
}
