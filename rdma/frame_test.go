package rdma

import (
	"bytes"
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// realFrames returns one encoded frame of each type.
func realFrames() [][]byte {
	tok := [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
	var out [][]byte
	out = append(out, appendHello(nil, "prefill-0", "decode-1"))

	d := make([]byte, headerSize)
	(&header{typ: frameData, index: 1, grant: 7, epoch: 99, token: tok, offset: 4096, length: 5}).put(d)
	out = append(out, append(d, 'h', 'e', 'l', 'l', 'o'))

	m := Manifest{Bytes: []uint64{4096, 5}, CRC: []uint32{0xdeadbeef, 42}}
	c := make([]byte, headerSize+2*manifestEntrySize)
	(&header{typ: frameCommit, index: 2, grant: 7, epoch: 99, token: tok, length: 2 * manifestEntrySize}).put(c)
	putManifest(c[headerSize:], &m)
	out = append(out, c)

	r := make([]byte, headerSize)
	(&header{typ: frameReply, index: codeRevoked, grant: 7, epoch: 99, length: 7}).put(r)
	out = append(out, append(r, "revoked"...))

	a := make([]byte, headerSize)
	(&header{typ: frameAbort, index: codeOutOfRange, grant: 7, epoch: 99, token: tok, length: 3}).put(a)
	out = append(out, append(a, "bad"...))

	fl := make([]byte, headerSize)
	(&header{typ: frameFlush, grant: 7, epoch: 99, token: tok}).put(fl)
	out = append(out, fl)
	return out
}

func TestDecodeFrameRoundTrip(t *testing.T) {
	for _, f := range realFrames() {
		got, n, err := decodeFrame(f)
		require.NoError(t, err)
		require.Equal(t, len(f), n)
		require.Equal(t, f, encodeFrame(&got))
		// Every strict prefix is refused as truncated.
		for i := 0; i < len(f); i++ {
			_, _, err := decodeFrame(f[:i])
			require.ErrorIs(t, err, ErrMalformedFrame, "prefix %d of type %d", i, f[4])
		}
	}
}

// encodeFrame is the inverse of decodeFrame.
func encodeFrame(f *frame) []byte {
	b := make([]byte, headerSize)
	f.header.put(b)
	if f.typ == frameCommit {
		p := make([]byte, len(f.manifest.Bytes)*manifestEntrySize)
		putManifest(p, &f.manifest)
		return append(b, p...)
	}
	return append(b, f.payload...)
}

func FuzzDecodeFrame(f *testing.F) {
	for _, fr := range realFrames() {
		f.Add(fr)
	}
	all := bytes.Join(realFrames(), nil)
	f.Add(all)
	f.Add(all[:100])
	f.Fuzz(func(t *testing.T, b []byte) {
		for len(b) > 0 {
			fr, n, err := decodeFrame(b)
			if err != nil {
				require.ErrorIs(t, err, ErrMalformedFrame)
				return
			}
			require.Equal(t, headerSize+int(fr.length), n)
			require.Equal(t, b[:n], encodeFrame(&fr), "decode then encode is the identity")
			b = b[n:]
		}
	})
}

// FuzzReceiver feeds arbitrary frame streams to a real receiving connection
// and checks that nothing lands outside the open grant. Decodable frames get
// the real grant id, epoch and token patched in (when the first input byte
// is odd), so the extent and offset checks are what is being fuzzed.
func FuzzReceiver(f *testing.F) {
	tok := [16]byte{}
	for _, fr := range realFrames()[1:] {
		f.Add(append([]byte{1}, fr...))
	}
	d := make([]byte, headerSize)
	(&header{typ: frameData, index: 0, grant: 1, epoch: 1, token: tok, offset: 4000, length: 200}).put(d)
	f.Add(append(append([]byte{1}, d...), make([]byte, 200)...))
	(&header{typ: frameData, index: 1, grant: 1, epoch: 1, token: tok, offset: 0, length: 10}).put(d)
	f.Add(append(append([]byte{1}, d...), make([]byte, 10)...))

	e, err := New(Config{Agent: "fuzz-rx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(f, err)
	f.Cleanup(func() { e.Close() })
	dst, err := e.Register("dst", 64<<10)
	require.NoError(f, err)
	fill(dst.Bytes(), canary)
	exts := []Extent{{1, 1024, 4096}, {1, 16384, 8192}}

	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		g, err := e.OpenGrant(GrantSpec{RequestID: 1, Extents: exts, Deadline: time.Now().Add(time.Minute)})
		require.NoError(t, err)
		tk := g.Ticket()
		patch := in[0]&1 == 1
		stream := append([]byte(nil), in[1:]...)
		for rest := stream; len(rest) > 0; {
			fr, n, err := decodeFrame(rest)
			if err != nil {
				break
			}
			if patch && (fr.typ == frameData || fr.typ == frameCommit || fr.typ == frameAbort) {
				fr.grant, fr.epoch, fr.token = tk.Grant, tk.Epoch, tk.Token
				fr.header.put(rest)
			}
			rest = rest[n:]
		}
		server, client := net.Pipe()
		rc := newRxConn(e, server, TransportTCP)
		done := make(chan struct{})
		go func() { rc.serve(); close(done) }()
		go func() { _, _ = io.Copy(io.Discard, client) }()
		_, _ = client.Write(appendHello(nil, "fuzz-tx", "fuzz-rx"))
		_, _ = client.Write(stream)
		client.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("receiver did not end after the writer closed")
		}
		g.Revoke()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, _ = g.Wait(ctx)
		b := dst.Bytes()
		for i := range b {
			in := (i >= 1024 && i < 1024+4096) || (i >= 16384 && i < 16384+8192)
			if in {
				b[i] = canary
			} else if b[i] != canary {
				t.Fatalf("byte %d outside the grant changed", i)
			}
		}
	})
}
