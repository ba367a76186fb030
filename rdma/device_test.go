package rdma

import (
	"bytes"
	"testing"
)

// regionBytes returns a region's bytes: host memory itself, or a copy read
// back from a device region.
func regionBytes(r *Region) []byte {
	if r.dev == nil {
		return r.Bytes()
	}
	b := make([]byte, r.size)
	if _, err := r.dev.ReadAt(b, 0); err != nil {
		panic(err)
	}
	return b
}

// setRegion copies b to the start of a region.
func setRegion(r *Region, b []byte) {
	if r.dev == nil {
		copy(r.Bytes(), b)
		return
	}
	if _, err := r.dev.WriteAt(b, 0); err != nil {
		panic(err)
	}
}

// fillRegion sets every byte of a region to v.
func fillRegion(r *Region, v byte) {
	if r.dev == nil {
		fill(r.Bytes(), v)
		return
	}
	setRegion(r, bytes.Repeat([]byte{v}, int(r.size)))
}

func TestPullRoundTrip(t *testing.T) {
	var p pull
	p.buf.Handle.Reserved[0], p.buf.Handle.Reserved[63] = 1, 2
	p.buf.Base, p.buf.Size, p.buf.BufferID, p.buf.PID = 1<<40, 1<<20, 9, 1234
	p.buf.Device[5] = 7
	p.off, p.n = 4096, 8192
	var b [pullSize]byte
	putPull(b[:], &p)
	got, err := decodePull(b[:])
	if err != nil || got != p {
		t.Fatalf("decodePull = %+v, %v; want %+v", got, err, p)
	}
	for _, bad := range []func(*pull){
		func(p *pull) { p.buf.PID = 0 },
		func(p *pull) { p.buf.Size = 0 },
		func(p *pull) { p.n = 0 },
		func(p *pull) { p.off = p.buf.Size },
		func(p *pull) { p.n = p.buf.Size - p.off + 1 },
	} {
		q := p
		bad(&q)
		putPull(b[:], &q)
		if _, err := decodePull(b[:]); err == nil {
			t.Fatalf("decodePull accepted %+v", q)
		}
	}
}

func FuzzDecodePull(f *testing.F) {
	var b [pullSize]byte
	putPull(b[:], &pull{off: 16, n: 32, buf: bufFor(1<<20, 99)})
	f.Add(b[:])
	f.Add(make([]byte, pullSize))
	f.Fuzz(func(t *testing.T, in []byte) {
		p, err := decodePull(in)
		if err != nil {
			return
		}
		if p.n == 0 || p.off+p.n > p.buf.Size || p.buf.PID <= 0 {
			t.Fatalf("decodePull accepted %+v", p)
		}
		var out [pullSize]byte
		putPull(out[:], &p)
		if !bytes.Equal(out[:], in) {
			t.Fatalf("re-encoding differs")
		}
	})
}
