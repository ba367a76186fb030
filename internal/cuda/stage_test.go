//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"bytes"
	"context"
	"errors"
	"hash/crc32"
	"io"
	"net"
	"testing"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/cuda/cudafake"
	"github.com/handoff-io/handoff/internal/leakcheck"
)

// TestStagedTCP moves device memory GPU -> pinned -> tcp -> pinned -> GPU
// between two devices (two executors, as two processes would have) and
// checks the bytes by crc32 on both sides.
func TestStagedTCP(t *testing.T) {
	leakcheck.Check(t)
	eachDriver(t, func(t *testing.T, _ string, drv cuda.Driver) {
		send := openDev(t, drv, "0")
		recv := openDev(t, drv, "0")
		const n = 5<<20 + 777 // not a multiple of the chunk
		src, _ := send.Alloc(n)
		dst, _ := recv.Alloc(n)
		defer send.Free(src) //nolint:errcheck
		defer recv.Free(dst) //nolint:errcheck
		data := fill(n, 4)
		if err := send.CopyToDevice(src, data); err != nil {
			t.Fatal(err)
		}
		ss, err := cuda.NewStager(send, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		defer ss.Close()
		rs, err := cuda.NewStager(recv, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		defer rs.Close()

		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		sent := crc32.NewIEEE()
		errc := make(chan error, 1) // the sender reports once
		go func() {
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				errc <- err
				return
			}
			defer c.Close()
			errc <- ss.Send(context.Background(), io.MultiWriter(c, sent), src, n)
		}()
		c, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		got := crc32.NewIEEE()
		if err := rs.Receive(context.Background(), io.TeeReader(c, got), dst, n); err != nil {
			t.Fatal(err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		want := crc32.ChecksumIEEE(data)
		if sent.Sum32() != want || got.Sum32() != want {
			t.Errorf("crc sent %08x received %08x, want %08x", sent.Sum32(), got.Sum32(), want)
		}
		back := make([]byte, n)
		if err := recv.CopyFromDevice(back, dst); err != nil || !bytes.Equal(back, data) {
			t.Errorf("bytes on the receiving device differ (%v)", err)
		}
	})
}

// TestStagedErrors: a short stream and a failing writer end the transfer
// with an error and leave no copy in flight (the fake counts events).
func TestStagedErrors(t *testing.T) {
	fake := cudafake.New(cudafake.Config{Polls: 2})
	d := openDev(t, fake, "0")
	s, err := cuda.NewStager(d, 1<<10)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, _ := d.Alloc(8 << 10)
	defer d.Free(p) //nolint:errcheck
	err = s.Receive(context.Background(), bytes.NewReader(make([]byte, 3000)), p, 8<<10)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("short stream: %v", err)
	}
	errBroken := errors.New("broken pipe")
	err = s.Send(context.Background(), failWriter{errBroken}, p, 8<<10)
	if !errors.Is(err, errBroken) {
		t.Errorf("failing writer: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Send(ctx, io.Discard, p, 8<<10); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled send: %v", err)
	}
	if st := fake.Stats(); st.Pending != 0 {
		t.Errorf("%d copies left in flight", st.Pending)
	}
}

type failWriter struct{ err error }

func (f failWriter) Write([]byte) (int, error) { return 0, f.err }

// TestStagedEachFill: the chunk callbacks see every byte once, in order,
// at the right offsets, with chunks no larger than the buffers.
func TestStagedEachFill(t *testing.T) {
	d := openDev(t, cudafake.New(cudafake.Config{Polls: 3}), "0")
	s, err := cuda.NewStager(d, 1000)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const n = 4321
	src, _ := d.Alloc(n)
	dst, _ := d.Alloc(n)
	defer d.Free(src) //nolint:errcheck
	defer d.Free(dst) //nolint:errcheck
	data := fill(n, 6)
	_ = d.CopyToDevice(src, data)
	var seen []byte
	err = s.Each(context.Background(), src, n, func(off uint64, b []byte) error {
		if off != uint64(len(seen)) || len(b) > 1000 {
			t.Errorf("chunk at %d of %d bytes after %d", off, len(b), len(seen))
		}
		seen = append(seen, b...)
		return nil
	})
	if err != nil || !bytes.Equal(seen, data) {
		t.Fatalf("Each: %v, bytes equal %v", err, bytes.Equal(seen, data))
	}
	err = s.Fill(context.Background(), dst, n, func(off uint64, b []byte) error {
		copy(b, seen[off:])
		return nil
	})
	got := make([]byte, n)
	if err := errors.Join(err, d.CopyFromDevice(got, dst)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Fill: %v", err)
	}
}
