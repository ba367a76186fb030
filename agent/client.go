package agent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/handoff-io/handoff/rdma"
)

// Client is an engine's side of the local API, in Go (tests and Go
// engines; python/ has the Python one). One Client is one registration:
// when it closes, the agent revokes its grants and unmaps its memory.
// Methods are safe for concurrent use; events arrive on Events.
type Client struct {
	c      *net.UnixConn
	events chan Reply

	wmu    sync.Mutex
	mu     sync.Mutex
	nextID uint64
	calls  map[uint64]chan Reply
	err    error
	done   chan struct{}
	// released: the agent ended the connection after Close began, as it
	// does once it let the registration's memory go; held: it said the
	// memory is not safe yet (EvQuarantined). Under mu.
	released bool
	held     string

	closeOnce sync.Once
	closing   chan struct{} // closed by Close: events are dropped from then on
}

// eventBuffer is how many events a Client holds for a reader that is
// behind; the reader goroutine blocks past it (replies wait behind the
// event), until the events are read or the Client is closed.
const eventBuffer = 1024

// Dial connects to the agent at socket and says hello.
func Dial(ctx context.Context, socket string) (*Client, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return nil, fmt.Errorf("agent: dial: %w", err)
	}
	c := &Client{c: nc.(*net.UnixConn), events: make(chan Reply, eventBuffer), calls: map[uint64]chan Reply{}, done: make(chan struct{}), closing: make(chan struct{})}
	go c.read()
	if _, err := c.Call(ctx, Request{Op: OpHello, Version: Version}, nil); err != nil {
		// Nothing registered: no wait for the agent (which may not even
		// have accepted the connection yet).
		c.closeOnce.Do(func() { close(c.closing) })
		c.c.Close()
		<-c.done
		return nil, err
	}
	return c, nil
}

// Events delivers grant and send events; it is closed when the connection ends.
func (c *Client) Events() <-chan Reply { return c.events }

// CloseWait bounds how long Close waits for the agent to let the
// registration's memory go.
const CloseWait = 30 * time.Second

// Close ends the registration: it closes its side of the connection and
// waits, up to CloseWait, for the agent to close its own, which it does
// once it revoked the grants, waited out any writer still copying into
// them and unmapped the memory. Once Close returned nil the engine may use
// its memory again, or register it anew. An error says that was not
// confirmed: the wait ran out (the agent may still be waiting for such a
// writer), the agent said the memory is not safe yet (rdma.ErrQuarantined),
// or the connection had ended before (the agent stopped or died, or sent
// what is not a frame of its): the memory is not known to be safe.
func (c *Client) Close() error {
	c.closeOnce.Do(func() { close(c.closing) })
	var err error
	if c.c.CloseWrite() == nil {
		t := time.NewTimer(CloseWait)
		select {
		case <-c.done:
		case <-t.C:
			err = fmt.Errorf("%w: the agent did not let the registration's memory go in %s", ErrClosed, CloseWait)
		}
		t.Stop()
	}
	c.c.Close()
	<-c.done
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case err != nil:
	case c.held != "":
		err = fmt.Errorf("%w: the agent stopped with the memory still written: %s", rdma.ErrQuarantined, c.held)
	case !c.released:
		err = fmt.Errorf("%w: the connection ended before Close: the agent's release of the memory is not confirmed", ErrClosed)
	}
	return err
}

func (c *Client) read() {
	defer close(c.done)
	defer close(c.events)
	r := bufio.NewReader(c.c)
	var err error
	for {
		var b []byte
		if b, err = readFrame(r); err != nil {
			break
		}
		var rep Reply
		if rep, err = decodeReply(b); err != nil {
			break
		}
		if rep.Ev != "" {
			if rep.Ev == EvQuarantined {
				c.mu.Lock()
				c.held = rep.Msg
				c.mu.Unlock()
			}
			select {
			case c.events <- rep:
			case <-c.closing: // no one reads them any more
			}
			continue
		}
		c.mu.Lock()
		ch := c.calls[rep.Re]
		delete(c.calls, rep.Re)
		c.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
	c.mu.Lock()
	select {
	case <-c.closing:
		c.released = errors.Is(err, io.EOF)
	default: // the agent ended it first (it stopped, or died)
	}
	c.err = fmt.Errorf("%w: connection to the agent: %w", ErrClosed, err)
	for id, ch := range c.calls {
		close(ch)
		delete(c.calls, id)
	}
	c.mu.Unlock()
}

// decodeReply decodes a reply or event frame's body.
func decodeReply(b []byte) (Reply, error) {
	var r Reply
	if err := unmarshal(b, &r); err != nil {
		return Reply{}, fmt.Errorf("%w: reply: %w", ErrBadRequest, err)
	}
	if (r.Re == 0) == (r.Ev == "") {
		return Reply{}, fmt.Errorf("%w: a message that is %s", ErrBadRequest, map[bool]string{true: "neither a reply nor an event", false: "both a reply and an event"}[r.Re == 0])
	}
	return r, nil
}

// Call sends q (with fds attached by SCM_RIGHTS) and waits for its reply;
// a failure the agent reports is a *RemoteError.
func (c *Client) Call(ctx context.Context, q Request, fds []int) (Reply, error) {
	ch := make(chan Reply, 1)
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return Reply{}, c.err
	}
	c.nextID++
	q.ID = c.nextID
	c.calls[q.ID] = ch
	c.mu.Unlock()
	forget := func() {
		c.mu.Lock()
		delete(c.calls, q.ID)
		c.mu.Unlock()
	}
	b, err := msgpack.Marshal(q)
	if err != nil {
		forget()
		return Reply{}, err
	}
	frame := make([]byte, 4+len(b))
	frame[0], frame[1], frame[2], frame[3] = byte(len(b)>>24), byte(len(b)>>16), byte(len(b)>>8), byte(len(b))
	copy(frame[4:], b)
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	// The descriptors ride with the first bytes; a stream socket may take
	// fewer than the frame (a ticket of megabytes), so the rest follows.
	c.wmu.Lock()
	n, _, err := c.c.WriteMsgUnix(frame, oob, nil)
	if err == nil && n < len(frame) {
		_, err = c.c.Write(frame[n:])
	}
	c.wmu.Unlock()
	if err != nil {
		// Part of a frame may have gone: nothing after it would be read
		// as the agent's next frame, so the connection ends here.
		forget()
		c.c.Close()
		return Reply{}, fmt.Errorf("%w: %w", ErrClosed, err)
	}
	select {
	case rep, ok := <-ch:
		if !ok {
			c.mu.Lock()
			defer c.mu.Unlock()
			return Reply{}, c.err
		}
		if rep.Code != "" {
			return rep, &RemoteError{Code: rep.Code, Msg: rep.Msg}
		}
		return rep, nil
	case <-ctx.Done():
		forget()
		return Reply{}, ctx.Err()
	}
}

// Register passes the pools' memory (memfds; -1 for a pool the layout has
// not) and their layout.
func (c *Client) Register(ctx context.Context, l Layout, kvFD int, kvBytes int64, mambaFD int, mambaBytes int64) (Reply, error) {
	var fds []int
	if kvFD >= 0 {
		fds = append(fds, kvFD)
	}
	if mambaFD >= 0 {
		fds = append(fds, mambaFD)
	}
	return c.Call(ctx, Request{Op: OpRegister, Layout: &l, KVBytes: kvBytes, MambaBytes: mambaBytes}, fds)
}

// Row returns a pointer for Request.Row.
func Row(r int) *int { return &r }

// WaitEvent returns the next event that ev matches, dropping others.
func (c *Client) WaitEvent(ctx context.Context, match func(Reply) bool) (Reply, error) {
	for {
		select {
		case e, ok := <-c.events:
			if !ok {
				c.mu.Lock()
				defer c.mu.Unlock()
				return Reply{}, errors.Join(ErrClosed, c.err)
			}
			if match(e) {
				return e, nil
			}
		case <-ctx.Done():
			return Reply{}, ctx.Err()
		}
	}
}
