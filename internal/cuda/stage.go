package cuda

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// DefaultStageChunk is a staging buffer's size: large enough that a copy
// engine runs at full speed, small enough that two of them overlap a
// socket well (UCX stages cuda memory in 4 MiB fragments).
const DefaultStageChunk = 4 << 20

// Stager moves device memory through two pinned host buffers, for
// transports that cannot read device memory (tcp): while chunk i is on the
// wire, chunk i+1 is being copied between the device and the other buffer.
// A Stager serves one transfer at a time; it is not safe for concurrent
// use.
type Stager struct {
	d     *Device
	chunk uint64
	bufs  [2]*Pinned
}

// NewStager allocates the two pinned buffers of chunk bytes each (0:
// DefaultStageChunk).
func NewStager(d *Device, chunk uint64) (*Stager, error) {
	if chunk == 0 {
		chunk = DefaultStageChunk
	}
	s := &Stager{d: d, chunk: chunk}
	for i := range s.bufs {
		b, err := d.AllocPinned(chunk)
		if err != nil {
			return nil, errors.Join(fmt.Errorf("cuda: staging buffer: %w", err), s.Close())
		}
		s.bufs[i] = b
	}
	return s, nil
}

// Close frees the buffers.
func (s *Stager) Close() error {
	var errs []error
	for i, b := range s.bufs {
		if b != nil {
			errs = append(errs, b.Free())
			s.bufs[i] = nil
		}
	}
	return errors.Join(errs...)
}

// Send writes the n bytes at src to w in order. The device-to-host copy of
// the next chunk runs while w takes the current one. ctx is checked
// between chunks; to bound a blocked w, give it a deadline (a net.Conn's
// SetWriteDeadline). No copy is in flight when Send returns.
func (s *Stager) Send(ctx context.Context, w io.Writer, src DevicePtr, n uint64) error {
	return s.Each(ctx, src, n, func(off uint64, b []byte) error {
		if _, err := w.Write(b); err != nil {
			return fmt.Errorf("cuda: staged send at byte %d of %d: %w", off, n, err)
		}
		return nil
	})
}

// Each hands the n bytes at src to fn chunk by chunk, in order, each in a
// pinned buffer that is valid until fn returns: a transport frames, sums
// and sends it there, while the device-to-host copy of the next chunk
// runs. off is the chunk's offset from src. ctx is checked between
// chunks; no copy is in flight when Each returns.
func (s *Stager) Each(ctx context.Context, src DevicePtr, n uint64, fn func(off uint64, b []byte) error) (err error) {
	var inflight *Copy
	defer func() {
		if inflight != nil {
			err = errors.Join(err, inflight.Wait())
		}
	}()
	next := func(i int, off uint64) error {
		if off >= n {
			return nil
		}
		c, err := s.d.SubmitDtoH(s.bufs[i%2].Ptr(), src+DevicePtr(off), min(s.chunk, n-off))
		inflight = c
		return err
	}
	if err := next(0, 0); err != nil {
		return err
	}
	for i, off := 0, uint64(0); off < n; i++ {
		m := min(s.chunk, n-off)
		c := inflight
		inflight = nil
		if err := c.Wait(); err != nil {
			return err
		}
		if err := next(i+1, off+m); err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(off, s.bufs[i%2].Bytes()[:m]); err != nil {
			return err
		}
		off += m
	}
	return nil
}

// Receive reads n bytes from r into dst. The host-to-device copy of a chunk
// runs while the next one is read from r. ctx is checked between chunks;
// bound a blocked r with a read deadline. No copy is in flight when
// Receive returns, and the bytes are on the device when it returns nil.
func (s *Stager) Receive(ctx context.Context, r io.Reader, dst DevicePtr, n uint64) error {
	return s.Fill(ctx, dst, n, func(off uint64, b []byte) error {
		if _, err := io.ReadFull(r, b); err != nil {
			return fmt.Errorf("cuda: staged receive at byte %d of %d: %w", off, n, err)
		}
		return nil
	})
}

// Fill has fn fill n bytes for dst chunk by chunk, in order, each into a
// pinned buffer (a transport reads a frame's payload there and sums it),
// and copies each to the device while fn fills the next. No copy is in
// flight when Fill returns, and the bytes are on the device when it
// returns nil.
func (s *Stager) Fill(ctx context.Context, dst DevicePtr, n uint64, fn func(off uint64, b []byte) error) (err error) {
	var inflight [2]*Copy
	defer func() {
		for _, c := range inflight {
			if c != nil {
				err = errors.Join(err, c.Wait())
			}
		}
	}()
	for i, off := 0, uint64(0); off < n; i++ {
		m := min(s.chunk, n-off)
		if c := inflight[i%2]; c != nil { // the buffer's last copy must be done before it is refilled
			inflight[i%2] = nil
			if err := c.Wait(); err != nil {
				return err
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		b := s.bufs[i%2]
		if err := fn(off, b.Bytes()[:m]); err != nil {
			return err
		}
		c, err := s.d.SubmitHtoD(dst+DevicePtr(off), b.Ptr(), m)
		if err != nil {
			return err
		}
		inflight[i%2] = c
		off += m
	}
	return nil
}
