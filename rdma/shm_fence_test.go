//go:build linux

package rdma

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Regression tests for the shm fence (the grant's promise: nothing lands
// after Revoke or settle), each built around one interleaving that broke it:
// a stale commit reply read as another write's verdict, a live writer's
// connection cut by the receiver, a commit's fence closing a slot already
// reused by the next grant, and a desynchronised control stream.

// staleReplyRun sets up the interleaving behind a stale commit reply: a
// big write W1 is past ready() and copying when a small write A sends its
// commit, which the receiver holds (a landing still in flight would). Once
// W1 copied all and waits for the link, the grant of W1 (ownRevoked) or of
// A is revoked and A's exchange is cut by its context, so A's reply is
// still to come on the connection W1 would use for its own commit. It
// returns W1's Write error and W1's grant's outcome.
func staleReplyRun(t *testing.T, agent string, ownRevoked bool) (errW1, g1Err error) {
	bg := context.Background()
	rx, err := New(Config{Agent: AgentID("rx-" + agent), Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer rx.Close()
	tx, err := New(Config{Agent: AgentID("tx-" + agent), Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer tx.Close()
	const big = 512 << 20
	dst, err := rx.Register("dst", big+8192)
	require.NoError(t, err)
	src, err := tx.Register("src", big+8192)
	require.NoError(t, err)
	desc := rx.Descriptor()
	_, err = tx.Connect(bg, desc)
	require.NoError(t, err)

	gA, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: dst.ID(), Offset: big, Length: 4096}}})
	require.NoError(t, err)
	g1, err := rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: dst.ID(), Offset: 0, Length: big}}})
	require.NoError(t, err)
	// Hold A's commit on the receiver, as a landing still in flight would.
	gA.mu.Lock()
	gA.inflight++
	gA.mu.Unlock()

	sl1 := slotAt(rx.shm.table, rx.shm.slotOf(g1.ID()))
	w1 := make(chan error, 1)
	go func() {
		_, err := tx.Write(bg, desc, g1.Ticket(), []Extent{{Region: src.ID(), Offset: 0, Length: big}})
		w1 <- err
	}()
	for sl1.copied().Load() == 0 { // W1 is past ready() and copying
		time.Sleep(50 * time.Microsecond)
	}
	ctxA, cancelA := context.WithTimeout(bg, time.Minute) // a deadline, cancelled early (a decoder's cancel)
	defer cancelA()
	wa := make(chan error, 1)
	go func() {
		_, err := tx.Write(ctxA, desc, gA.Ticket(), []Extent{{Region: src.ID(), Offset: big, Length: 4096}})
		wa <- err
	}()
	for { // A's commit reached the receiver, which holds it
		gA.mu.Lock()
		st := gA.state
		gA.mu.Unlock()
		if st == grantCommitting {
			break
		}
		time.Sleep(50 * time.Microsecond)
	}
	require.Less(t, sl1.copied().Load(), uint64(big), "W1 must still be copying when A's exchange starts")
	for sl1.copied().Load() != big || wordState(sl1.state().Load()) != slotOpen { // W1 copied all, now waits for l.mu
		time.Sleep(50 * time.Microsecond)
	}
	time.Sleep(20 * time.Millisecond)
	revoked := make(chan struct{})
	if ownRevoked {
		g1.Revoke() // W1's grant is revoked before its commit is read
		close(revoked)
	} else {
		go func() { gA.Revoke(); close(revoked) }() // A's commit will be refused (Revoke waits for the held commit)
		time.Sleep(20 * time.Millisecond)
	}
	cancelA() // A's exchange is cut: the link is broken, A's reply still to come
	t.Logf("A: %v", <-wa)
	time.Sleep(50 * time.Millisecond) // W1 sent its commit on the same connection
	gA.mu.Lock()
	gA.inflight--
	gA.quiet.Broadcast()
	gA.mu.Unlock()
	errW1 = <-w1
	_, gAerr := gA.Wait(bg)
	<-revoked
	_, g1Err = g1.Wait(bg)
	t.Logf("gA (A's grant): %v; g1 (W1's grant): %v; W1's Write returned: %v", gAerr, g1Err, errW1)
	return errW1, g1Err
}

// A commit exchange cut by its context leaves the receiver's reply on the
// control connection; the link is marked broken, but a write that passed
// ready() before that used the same connection for its own commit and read
// the stale reply as its verdict: success for a revoked grant.
func TestSHMStaleReplyNotTakenForRevokedGrant(t *testing.T) {
	errW1, g1Err := staleReplyRun(t, "stale", true)
	require.ErrorIs(t, g1Err, ErrRevoked)
	require.Error(t, errW1, "W1's Write reported success for a revoked grant (it read A's commit reply)")
}

// The receiver ends a live writer's control connection when a frame on it is
// malformed (a desynchronised stream: e.g. a commit frame cut mid-write by a
// cancelled exchange, followed by another write's commit on the same
// connection). shmRxState.closed then treats the writer as dead: the grants it
// was copying into are terminated and the fence closes a slot that is in a
// live bracket, so the writer's copy goes on landing after the grant settled.
func TestSHMReceiverCutLiveWriterLandsNothingAfterSettle(t *testing.T) {
	bg := context.Background()
	rx, err := New(Config{Agent: "rx-stale2", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer rx.Close()
	tx, err := New(Config{Agent: "tx-stale2", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer tx.Close()
	const big = 512 << 20
	dst, err := rx.Register("dst", big)
	require.NoError(t, err)
	src, err := tx.Register("src", big)
	require.NoError(t, err)
	fill(src.Bytes(), 0x5A)
	fill(dst.Bytes(), canary)
	desc := rx.Descriptor()
	_, err = tx.Connect(bg, desc)
	require.NoError(t, err)
	tx.peerMu.Lock()
	l := tx.peers[rx.Agent()].link.(*shmLink)
	tx.peerMu.Unlock()

	g, err := rx.OpenGrant(GrantSpec{RequestID: 7, Extents: []Extent{{Region: dst.ID(), Offset: 0, Length: big}}})
	require.NoError(t, err)
	sl := slotAt(rx.shm.table, rx.shm.slotOf(g.ID()))
	w := make(chan error, 1)
	go func() {
		_, err := tx.Write(bg, desc, g.Ticket(), []Extent{{Region: src.ID(), Offset: 0, Length: big}})
		w <- err
	}()
	for sl.copied().Load() < 8<<20 { // well inside the copy
		time.Sleep(20 * time.Microsecond)
	}
	// Desynchronised control stream: half a frame, then more bytes.
	garbage := make([]byte, 64)
	l.mu.Lock()
	_, err = l.conn.Write(garbage)
	l.mu.Unlock()
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	_, gerr := g.Wait(ctx) // the grant settles: "no byte lands any more"
	c0 := sl.copied().Load()
	snap := make([]byte, 4<<20)
	copy(snap, dst.Bytes()[c0:])
	werr := <-w
	c1 := sl.copied().Load()
	changed := 0
	for i := range snap {
		if snap[i] != dst.Bytes()[c0+uint64(i)] {
			changed++
		}
	}
	t.Logf("grant settled with %v (writer still live); copied at settle %d, after the write %d; write returned %v; bytes of [%d, +4MiB) changed after Done: %d",
		gerr, c0, c1, werr, c0, changed)
	require.Error(t, gerr)
	require.Equal(t, c0, c1, "a copy bracket that was in flight when the grant settled completed after it")
	require.Zero(t, changed, "bytes landed in the destination after the grant was Done")
}

// The commit path fences g's slot after releasing g.mu; a concurrent Revoke
// can settle and retire g meanwhile and the slot be handed to a new grant.
// fence checks the slot's grant id once, then CASes whatever open word it
// finds: it closes the new grant's slot.
func TestSHMCommitFenceLeavesReusedSlotOpen(t *testing.T) {
	bg := context.Background()
	rx, err := New(Config{Agent: "rx-stale3", Transports: []Transport{TransportSHM}, Logger: quietLogger(), MaxGrants: 1})
	require.NoError(t, err)
	defer rx.Close()
	tx, err := New(Config{Agent: "tx-stale3", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer tx.Close()
	dst, err := rx.Register("dst", 1<<20)
	require.NoError(t, err)
	_, err = tx.Register("src", 1<<20)
	require.NoError(t, err)
	_, err = tx.Connect(bg, rx.Descriptor())
	require.NoError(t, err)
	tx.peerMu.Lock()
	wid := tx.peers[rx.Agent()].link.(*shmLink).wid
	tx.peerMu.Unlock()
	ext := []Extent{{Region: dst.ID(), Offset: 0, Length: 4096}}
	hits := 0
	for range 40 {
		g1, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: ext})
		require.NoError(t, err)
		sl := slotAt(rx.shm.table, rx.shm.slotOf(g1.ID()))
		e1 := g1.Ticket().Epoch
		require.True(t, sl.state().CompareAndSwap(slotWord(slotOpen, 0, e1), slotWord(slotWriting, wid, e1))) // a bracket in progress
		a := make(chan struct{})
		go func() { rx.shm.fence(g1, time.Minute); close(a) }() // the commit's fence (Grant.commit after g.mu.Unlock)
		b := make(chan struct{})
		go func() { g1.Revoke(); close(b) }()
		time.Sleep(2 * time.Millisecond)
		sl.state().Store(slotWord(slotOpen, 0, e1)) // the bracket ends
		<-b
		g3, err := rx.OpenGrant(GrantSpec{RequestID: 3, Extents: ext}) // the slot is reused
		require.NoError(t, err)
		<-a
		if w := sl.state().Load(); sl.grant().Load() == g3.ID() && wordState(w) != slotOpen {
			hits++
		}
		g3.Revoke()
	}
	t.Logf("new grant's slot closed by the old grant's commit fence in %d/40 runs", hits)
	require.Zero(t, hits)
}

// The other way round: the stale reply is a refusal (A's grant revoked),
// and W1's Write returned it for its own accepted commit.
func TestSHMStaleReplyNotTakenForCommittedGrant(t *testing.T) {
	errW1, g1Err := staleReplyRun(t, "stale4", false)
	require.NoError(t, g1Err, "W1's grant is committed")
	require.NoError(t, errW1, "W1's Write reported A's refusal for its own accepted commit")
}

// Deterministic form, modelled on TestSHMRevokeWaitsForCopyBracket: a live
// writer is inside a copy bracket; its control stream desynchronises and
// the receiver cuts it. The grant fails at once, but its destination is
// quarantined (Done stays open) until the bracket ends, which the writer
// does by closing the slot the fence marked.
func TestSHMDesyncedWriterBracketHoldsDone(t *testing.T) {
	p := newPair(t, TransportSHM)
	g, err := p.rx.OpenGrant(GrantSpec{RequestID: 1, Extents: dstExtents()})
	require.NoError(t, err)
	tk := g.Ticket()
	l, sl := shmSlot(t, p, g)
	writing := slotWord(slotWriting, l.wid, tk.Epoch)
	require.True(t, sl.state().CompareAndSwap(slotWord(slotOpen, 0, tk.Epoch), writing), "writer enters a copy bracket")
	sl.writer().Store(l.wid)
	l.mu.Lock()
	_, err = l.conn.Write(make([]byte, headerSize)) // e.g. the tail of a commit frame cut by a cancelled exchange
	l.mu.Unlock()
	require.NoError(t, err)
	select {
	case <-g.Failed():
	case <-time.After(5 * time.Second):
		t.Fatal("the grant of a cut writer did not fail")
	}
	require.ErrorIs(t, g.Err(), ErrPeerClosed)
	require.True(t, g.Quarantined())
	require.Equal(t, tk.Bytes, p.rx.Stats().QuarantinedBytes)
	select {
	case <-g.Done():
		t.Fatalf("grant settled (%v) while a live writer was inside a copy bracket; slot now %#x", g.Err(), sl.state().Load())
	case <-time.After(200 * time.Millisecond):
	}
	// The writer's bracket ends: its closing CAS finds the fence's mark and
	// closes the slot, as copyAll does.
	fencing := slotWord(slotFencing, l.wid, tk.Epoch)
	require.Equal(t, fencing, sl.state().Load())
	require.False(t, sl.state().CompareAndSwap(writing, slotWord(slotOpen, 0, tk.Epoch)))
	require.True(t, sl.state().CompareAndSwap(fencing, slotWord(slotClosed, 0, tk.Epoch)))
	select {
	case <-g.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the quarantine did not end with the bracket")
	}
	require.False(t, g.Quarantined())
	require.Zero(t, p.rx.Stats().QuarantinedBytes)
}
