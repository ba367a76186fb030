package agent

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/rdma"
)

// TestGroupFailureRevokesAtOnce: when one grant of a group fails, the
// others are revoked and the event sent at once, whichever grant failed:
// not once the grants before it ended (here never, without a deadline).
func TestGroupFailureRevokesAtOnce(t *testing.T) {
	eng, err := rdma.New(rdma.Config{Agent: "group", Transports: []rdma.Transport{rdma.TransportInproc}, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer eng.Close()
	r, err := eng.Register("kv", 4096)
	require.NoError(t, err)
	grp := &grantGroup{req: 3}
	for i := range 3 {
		g, err := eng.OpenGrant(rdma.GrantSpec{RequestID: 3, Extents: []rdma.Extent{{Region: r.ID(), Offset: uint64(i) * 1024, Length: 1024}}})
		require.NoError(t, err)
		grp.gs = append(grp.gs, g)
	}
	grp.id = grp.gs[0].ID()
	pr, pw := io.Pipe()
	defer pr.Close()
	m, err := newMetrics(nil)
	require.NoError(t, err)
	s := &session{a: &Agent{m: m}, w: bufio.NewWriter(pw), grants: map[uint64]*grantGroup{grp.id: grp}}
	done := make(chan struct{})
	replied := make(chan struct{})
	go func() {
		defer close(done)
		s.watchGrant(grp, replied)
	}()
	grp.gs[2].Revoke() // the last shard's grant fails first
	frame := make(chan []byte, 1)
	go func() {
		b, _ := readFrame(pr)
		frame <- b
	}()
	// The event waits for the reply to the grant request.
	select {
	case <-frame:
		t.Fatal("the grant's event came before the reply to its request")
	case <-time.After(100 * time.Millisecond):
	}
	close(replied)
	select {
	case b := <-frame:
		ev, err := decodeReply(b)
		require.NoError(t, err)
		require.Equal(t, EvGrantFailed, ev.Ev)
		require.Equal(t, grp.id, ev.Grant)
		require.Equal(t, "revoked", ev.Code)
	case <-time.After(10 * time.Second):
		t.Fatal("no event 10 s after a grant of the group failed")
	}
	<-done
	for i, g := range grp.gs {
		require.Error(t, g.Err(), "grant %d revoked with the group", i)
	}
	require.Empty(t, s.grants)
}

// TestGrantDeadlineBounded: a deadline past what a time.Duration holds in
// milliseconds (it wrapped into the past) is refused by name.
func TestGrantDeadlineBounded(t *testing.T) {
	e := register(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	_, err := e.c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 1, Blocks: []int{1}, DeadlineMS: 1 << 62}, nil)
	require.ErrorIs(t, err, ErrBadRequest)
	require.ErrorContains(t, err, "deadline")
	g, err := e.c.Call(ctxT(t), Request{Op: OpGrant, RequestID: 2, Blocks: []int{1}, DeadlineMS: maxDeadlineMS}, nil)
	require.NoError(t, err)
	require.NotZero(t, g.Grant)
}

// TestClientCloseWithEventsUnread: a Client whose events nobody reads
// (more than it buffers) still closes: its reader, blocked on the full
// buffer, gives up the events once Close is called.
func TestClientCloseWithEventsUnread(t *testing.T) {
	e := register(t, startAgent(t, "a", rdma.TransportSHM), tinyLayout())
	blocked := false
	for i := 0; i < eventBuffer+8 && !blocked; i++ {
		// Past the buffer the reader blocks, and the call waits to its
		// deadline behind the event.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		g, err := e.c.Call(ctx, Request{Op: OpGrant, RequestID: uint64(i + 1), Blocks: []int{1}}, nil)
		if err == nil {
			_, err = e.c.Call(ctx, Request{Op: OpRevoke, Grant: g.Grant}, nil)
		}
		cancel()
		blocked = err != nil
	}
	require.True(t, blocked, "the calls went on with %d events unread", eventBuffer+8)
	closed := make(chan error, 1)
	go func() { closed <- e.c.Close() }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close hung with its events unread")
	}
}
