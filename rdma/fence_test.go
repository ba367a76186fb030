package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The fence conformance tests hold every transport to the grant's promise
// (once Revoke returned, or the grant is Done, no byte lands in it) in the
// ways a data path misbehaves in production: the receiver cutting a live
// writer's connection, an exchange cut by its context while other writes
// share the link, a grant slot reused while an old fence still runs, and a
// writer process stopped (SIGSTOP, a frozen cgroup) inside a copy.

// bigPair is a receiver and a writer over tr with regions of size bytes
// (memfds: not Go memory), the source filled with 0x5A and the destination
// with the canary.
func bigPair(t *testing.T, tr Transport, size int64, rxCfg func(*Config)) (rx, tx *Engine, dst, src *Region) {
	t.Helper()
	cfg := Config{Agent: AgentID("rx-" + t.Name()), Transports: []Transport{tr}, Logger: quietLogger()}
	if rxCfg != nil {
		rxCfg(&cfg)
	}
	var err error
	rx, err = New(cfg)
	require.NoError(t, err)
	tx, err = New(Config{Agent: AgentID("tx-" + t.Name()), Transports: []Transport{tr}, Logger: quietLogger()})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, tx.Close())
		require.NoError(t, rx.Close())
	})
	dst, err = rx.Register("dst", size)
	require.NoError(t, err)
	src, err = tx.Register("src", size)
	require.NoError(t, err)
	fill(src.Bytes(), 0x5A)
	fill(dst.Bytes(), canary)
	got, err := tx.Connect(context.Background(), rx.Descriptor())
	require.NoError(t, err)
	require.Equal(t, tr, got)
	return rx, tx, dst, src
}

// waitFor polls cond every 20µs for up to 10s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s", what)
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// changedSince counts the bytes of b that differ from snap.
func changedSince(snap, b []byte) int {
	if bytes.Equal(snap, b) {
		return 0
	}
	n := 0
	for i := range snap {
		if snap[i] != b[i] {
			n++
		}
	}
	return n
}

// cutWriters closes every writer connection e serves, as the receiver does
// itself on a malformed frame; it returns how many it closed.
func cutWriters(e *Engine) int {
	n := 0
	if e.tcp != nil {
		e.tcp.mu.Lock()
		for c := range e.tcp.conns {
			c.c.Close()
			n++
		}
		e.tcp.mu.Unlock()
	}
	return n + cutSHMWriters(e) + cutUCXWriters(e)
}

// hold stops a data path at a hook (hooks.go) until let: the goroutine
// that reaches it blocks, and reached closes the first time one does.
type hold struct {
	reached, released chan struct{}
	once, letOnce     sync.Once
}

// newHold returns a hold that is let go at the end of the test at the
// latest, before its engines close (cleanups run last in, first out).
func newHold(t *testing.T) *hold {
	h := &hold{reached: make(chan struct{}), released: make(chan struct{})}
	t.Cleanup(h.let)
	return h
}

// stop is the hook's body: note the point reached, then wait for let.
func (h *hold) stop() {
	h.once.Do(func() { close(h.reached) })
	<-h.released
}

func (h *hold) let() { h.letOnce.Do(func() { close(h.released) }) }

// reach waits until ch closes: the test reached a point it arranged with a
// hook. A test whose case is never reached fails instead of passing by.
func reach(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("never reached: %s", what)
	}
}

// midWrite reports whether the writing hook, called after n bytes of a
// write, finds the writer in the middle of it: shm calls it inside each
// copy bracket (the slot says writing); tcp before each batch, in the
// middle once an earlier batch went out (the receiver is inside the
// landing of the frame that batch began); inproc inside each piece's
// landing, in the middle from the second piece on.
func midWrite(tr Transport, n uint64) bool { return n > 0 || tr == TransportSHM }

// landingIn reports whether a landing into g is in flight: the receiver
// is inside a data frame or piece of it.
func landingIn(g *Grant) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.inflight > 0
}

// signal returns a channel and a func that closes it, once.
func signal() (chan struct{}, func()) {
	ch := make(chan struct{})
	var once sync.Once
	return ch, func() { once.Do(func() { close(ch) }) }
}

// The receiver cuts a live writer's connection in the middle of a large
// write: once the grant settled, nothing more lands, whatever the writer
// still does; and the writer's verdict agrees with the grant's. The writer
// is held mid-write (shm: inside a copy bracket; tcp: inside a frame the
// receiver is landing) when the cut comes, and let go once the fence waits
// for it (shm) or the grant settled (tcp: the cut ends the landing).
func TestConformanceReceiverCutsLiveWriter(t *testing.T) {
	for _, tr := range testTransports() {
		t.Run(string(tr), func(t *testing.T) {
			if tr == TransportInproc {
				t.Skip("an in-process writer has no connection to cut")
			}
			const size = 256 << 20
			bg := context.Background()
			// The fence waits for the held writer for as long as the test needs.
			rx, tx, dst, src := bigPair(t, tr, size, func(c *Config) { c.FenceWait = time.Minute })
			g, err := rx.OpenGrant(GrantSpec{RequestID: 7, Extents: []Extent{{Region: dst.ID(), Length: size}}})
			require.NoError(t, err)
			h := newHold(t)
			tx.hooks.Store(&hooks{writing: func(tk *Ticket, n uint64) {
				if tk.Grant == g.ID() && midWrite(tr, n) {
					h.stop()
				}
			}})
			fenceWaits, waits := signal()
			rx.hooks.Store(&hooks{fenceWaits: func(*Grant) { waits() }})
			w := make(chan error, 1)
			go func() {
				_, err := tx.Write(bg, rx.Descriptor(), g.Ticket(), []Extent{{Region: src.ID(), Length: size}})
				w <- err
			}()
			reach(t, "the writer is held in the middle of its write", h.reached)
			if tr == TransportTCP {
				waitFor(t, "the receiver lands the held writer's frame", func() bool { return landingIn(g) })
			}
			require.Positive(t, cutWriters(rx), "no connection to cut")
			var snap []byte
			select {
			case <-fenceWaits: // shm: the fence waits for the bracket the writer is in
			case <-g.Done():
				snap = bytes.Clone(dst.Bytes()) // settled with the writer still held
			}
			h.let()
			ctx, cancel := context.WithTimeout(bg, 10*time.Second)
			defer cancel()
			_, gerr := g.Wait(ctx)
			require.NotErrorIs(t, gerr, context.DeadlineExceeded, "the grant never settled")
			if snap == nil {
				snap = bytes.Clone(dst.Bytes())
			}
			werr := <-w
			changed := changedSince(snap, dst.Bytes())
			t.Logf("grant: %v; write: %v; bytes changed after the grant settled: %d", gerr, werr, changed)
			require.Zero(t, changed, "bytes landed after the grant settled")
			require.Equal(t, gerr == nil, werr == nil, "writer and receiver disagree")
		})
	}
}

// Two writes share the writer's link to the receiver. One write's commit
// exchange is cut by its context while the receiver holds its verdict; the
// other write's Write must return its own grant's verdict, never the cut
// exchange's: nil exactly when its own grant committed. W1 is held right
// before its commit until A's exchange was cut, and A's verdict is held
// until W1's commit went out (shm: on the link A's cut broke).
func TestConformanceVerdictIsTheWritersOwn(t *testing.T) {
	for _, tr := range testTransports() {
		for _, c := range []struct{ revoke, ctx string }{
			{"own grant", "deadline"}, {"other grant", "deadline"}, {"own grant", "cancel"}, {"other grant", "cancel"},
		} {
			revoke := c.revoke
			t.Run(string(tr)+"/"+strings.ReplaceAll(revoke, " ", "_")+"_revoked/"+c.ctx, func(t *testing.T) {
				const big = 256 << 20
				bg := context.Background()
				rx, tx, dst, src := bigPair(t, tr, big+8192, nil)
				desc := rx.Descriptor()
				gA, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: dst.ID(), Offset: big, Length: 4096}}})
				require.NoError(t, err)
				g1, err := rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: dst.ID(), Length: big}}})
				require.NoError(t, err)
				// The receiver holds A's commit, as a landing still in
				// flight would.
				gA.mu.Lock()
				gA.inflight++
				gA.mu.Unlock()
				held := true
				release := func() {
					if held {
						held = false
						gA.mu.Lock()
						gA.inflight--
						gA.quiet.Broadcast()
						gA.mu.Unlock()
					}
				}
				defer release()
				h := newHold(t)
				w1sent, sent := signal()
				tx.hooks.Store(&hooks{
					commit: func(tk *Ticket) {
						if tk.Grant == g1.ID() {
							h.stop()
						}
					},
					sent: func(grant uint64) {
						if grant == g1.ID() {
							sent()
						}
					},
				})

				w1 := make(chan error, 1)
				go func() {
					_, err := tx.Write(bg, desc, g1.Ticket(), []Extent{{Region: src.ID(), Length: big}})
					w1 <- err
				}()
				reach(t, "W1 copied all and is about to commit", h.reached)
				// A's context: a deadline cancelled early (a decoder's
				// cancel), or a plain cancel.
				ctxA, cancelA := context.WithCancel(bg)
				if c.ctx == "deadline" {
					ctxA, cancelA = context.WithTimeout(bg, time.Minute)
				}
				defer cancelA()
				wa := make(chan error, 1)
				go func() {
					_, err := tx.Write(ctxA, desc, gA.Ticket(), []Extent{{Region: src.ID(), Offset: big, Length: 4096}})
					wa <- err
				}()
				waitFor(t, "A's commit reaches the receiver", func() bool {
					gA.mu.Lock()
					defer gA.mu.Unlock()
					return gA.state == grantCommitting
				})
				revoked := make(chan struct{})
				target := g1
				if revoke == "other grant" {
					target = gA // Revoke waits for the held commit where a landing could hold it
				}
				go func() { target.Revoke(); close(revoked) }()
				waitFor(t, "the revoked grant settles", func() bool { return target.Err() != nil })
				cancelA() // A's exchange is cut, its verdict still to come
				var errA error
				if tr != TransportInproc {
					errA = <-wa // an in-process commit is a call, not an exchange: nothing cuts it
				}
				h.let()
				reach(t, "W1's commit went out", w1sent)
				release()
				if tr == TransportInproc {
					errA = <-wa
				}
				var errW1 error
				select {
				case errW1 = <-w1:
				case <-time.After(10 * time.Second):
					t.Fatal("W1's Write did not return")
				}
				<-revoked
				_, g1err := g1.Wait(bg)
				_, gAerr := gA.Wait(bg)
				t.Logf("A: write %v, grant %v; W1: write %v, grant %v", errA, gAerr, errW1, g1err)
				require.Equal(t, g1err == nil, errW1 == nil, "W1's Write returned another exchange's verdict")
				if errW1 != nil {
					require.NotErrorIs(t, errW1, context.Canceled)
				}
			})
		}
	}
}

// A grant's destination is reused for the next grant (one grant slot: the
// shm slot is reused every round) while writes, commits and revokes of the
// old grant race: the new grant always takes its write, and nothing of the
// old write lands once its grant is Done. Each round revokes the old grant
// at one of the points a write passes, the writer held there by a hook.
func TestConformanceFenceVersusReuse(t *testing.T) {
	// The points, in round order. "copying": the writer is in the middle of
	// its data, and let go once the fence waits for it (shm: inside a copy
	// bracket; tcp: inside a frame the receiver is landing; inproc: inside
	// the landing of its second piece). "commit": every byte is in, the
	// commit about to go out. "sent": the commit went out and races the
	// revoke at the receiver.
	points := []string{"before", "copying", "commit", "sent"}
	for _, tr := range testTransports() {
		t.Run(string(tr), func(t *testing.T) {
			bg := context.Background()
			// Two source pieces (inproc lands them one by one), and two tcp
			// batches of one frame: the hook comes between them.
			const first, n = txBatchBytes, txBatchBytes + 512<<10
			rx, tx, dst, src := bigPair(t, tr, 2<<20, func(c *Config) { c.MaxGrants = 1; c.FenceWait = time.Minute })
			ext := []Extent{{Region: dst.ID(), Offset: 0, Length: n}}
			from := []Extent{{Region: src.ID(), Offset: 0, Length: first}, {Region: src.ID(), Offset: first, Length: n - first}}
			for i := range 40 {
				at := points[i%len(points)]
				fill(dst.Bytes(), canary) // what the old write lands after Done shows
				g1, err := rx.OpenGrant(GrantSpec{RequestID: uint64(2*i + 1), Extents: ext})
				require.NoError(t, err)
				h := newHold(t)
				sentCh, sent := signal()
				tx.hooks.Store(&hooks{
					writing: func(tk *Ticket, n uint64) {
						if at == "copying" && tk.Grant == g1.ID() && midWrite(tr, n) {
							h.stop()
						}
					},
					commit: func(tk *Ticket) {
						if at == "commit" && tk.Grant == g1.ID() {
							h.stop()
						}
					},
					sent: func(grant uint64) {
						if at == "sent" && grant == g1.ID() {
							sent()
						}
					},
				})
				fenceWaits, waits := signal()
				rx.hooks.Store(&hooks{fenceWaits: func(*Grant) { waits() }})
				revoked := make(chan struct{})
				revoke := func() { go func() { g1.Revoke(); close(revoked) }() }
				if at == "before" {
					revoke()
					<-revoked
				}
				w := make(chan error, 1)
				go func() { _, err := tx.Write(bg, rx.Descriptor(), g1.Ticket(), from); w <- err }()
				var snap []byte
				switch at {
				case "copying", "commit":
					reach(t, fmt.Sprintf("round %d: the writer is held (%s)", i, at), h.reached)
					// ucx: UCX moves a message's payload on the receiver's
					// worker, whatever the writer's goroutine does, so a
					// held writer holds no landing open.
					if at == "copying" && tr != TransportSHM && tr != TransportUCX {
						waitFor(t, "the receiver lands the held writer's data", func() bool { return landingIn(g1) })
					}
					revoke()
					select {
					case <-fenceWaits: // the fence waits for the held writer's copy or landing
					case <-revoked:
						snap = bytes.Clone(dst.Bytes()) // Done, with the writer still held
					}
					h.let()
				case "sent":
					reach(t, fmt.Sprintf("round %d: the commit went out", i), sentCh)
					revoke()
				}
				<-revoked
				<-g1.Done()
				if snap == nil {
					snap = bytes.Clone(dst.Bytes())
				}
				<-w
				require.Zero(t, changedSince(snap, dst.Bytes()), "round %d (%s): bytes of the old write landed after its grant was Done", i, at)
				h.let()
				tx.hooks.Store(nil)
				rx.hooks.Store(nil)
				g3, err := rx.OpenGrant(GrantSpec{RequestID: uint64(2*i + 2), Extents: ext})
				require.NoError(t, err, "round %d: the destination was not reusable after Done", i)
				_, err = tx.Write(bg, rx.Descriptor(), g3.Ticket(), from)
				require.NoError(t, err, "round %d: the new grant refused its write", i)
				_, err = g3.Wait(bg)
				require.NoError(t, err)
			}
		})
	}
}

// procState returns the state letter of /proc/pid/stat ('T': stopped).
func procState(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

// writerConns counts the writer connections e serves (tcp, shm control).
func writerConns(e *Engine) int {
	n := 0
	if e.tcp != nil {
		e.tcp.mu.Lock()
		n = len(e.tcp.conns)
		e.tcp.mu.Unlock()
	}
	return n + shmConns(e) + ucxConns(e)
}

// A writer process is stopped (SIGSTOP) in the middle of a write: Revoke
// returns within a bound and the grant fails at once. Where the stopped
// writer maps the destination (shm) and is inside a copy, the destination is
// quarantined: Done stays open, OpenGrant refuses the extents, the stats
// count the bytes, until the writer's copy ends (SIGCONT) or its process is
// gone (SIGKILL); nothing lands after Done either way. The writer stops
// itself at a hook in the middle of its write (shm: inside a copy bracket;
// tcp: inside a frame the receiver is landing; ucx: with messages whose
// payload the receiver is receiving, which a stopped writer's tcp
// fragments never finish).
func TestConformanceFrozenWriter(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	type end struct {
		name string
		sig  syscall.Signal
	}
	for _, tr := range crossTransports() {
		for _, how := range []end{{"resumed", syscall.SIGCONT}, {"killed", syscall.SIGKILL}} {
			t.Run(string(tr)+"/"+how.name, func(t *testing.T) {
				const size = 256 << 20
				const fenceWait = 20 * time.Millisecond
				rx, err := New(Config{Agent: "frozen-rx", Transports: []Transport{tr}, Logger: quietLogger(), FenceWait: fenceWait})
				require.NoError(t, err)
				defer rx.Close()
				dst, err := rx.Register("dst", size)
				require.NoError(t, err)
				fill(dst.Bytes(), canary)
				exts := []Extent{{Region: dst.ID(), Length: size}}
				g, err := rx.OpenGrant(GrantSpec{RequestID: 21, Extents: exts, Deadline: time.Now().Add(time.Minute)})
				require.NoError(t, err)
				cmd, _ := startWriter(t, helperJob{Transport: tr, Peer: rx.Descriptor(), Ticket: g.Ticket(), StopMidWrite: true})
				pid := cmd.Process.Pid
				defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
				waitFor(t, "the writer stops itself mid-write", func() bool { return procState(pid) == 'T' })
				if tr == TransportSHM {
					require.NotEqual(t, byte(canary), dst.Bytes()[0], "the writer stopped before its first bytes landed")
					require.True(t, shmWriting(rx, g)(), "the writer stopped outside a copy bracket")
				} else {
					waitFor(t, "the receiver lands the stopped writer's frame", func() bool { return landingIn(g) })
				}

				start := time.Now()
				revoked := make(chan struct{})
				go func() { g.Revoke(); close(revoked) }()
				select {
				case <-revoked:
				case <-time.After(5 * time.Second):
					_ = cmd.Process.Kill() // lets Revoke return, so the test can end
					<-revoked
					t.Fatal("Revoke waits for the stopped writer")
				}
				took := time.Since(start)
				// Where nothing is quarantined, Revoke is the fence: what the
				// destination holds now it holds for good (a sum, not a copy:
				// copying 256 MiB takes seconds under -race).
				atRevoke, fenced := crc32Update(0, dst.Bytes()), tr != TransportSHM
				t.Logf("Revoke returned after %s with the writer stopped", took)
				require.Less(t, took, 2*time.Second, "Revoke waited for a stopped writer")
				require.ErrorIs(t, g.Err(), ErrRevoked)
				select {
				case <-g.Failed():
				default:
					t.Fatal("a revoked grant's Failed is open")
				}
				if tr == TransportSHM {
					require.True(t, g.Quarantined())
					select {
					case <-g.Done():
						t.Fatal("Done closed while a live writer is inside a copy")
					default:
					}
					require.Equal(t, uint64(size), rx.Stats().QuarantinedBytes)
					require.Equal(t, uint64(1), rx.Stats().GrantsQuarantined)
					_, err := rx.OpenGrant(GrantSpec{RequestID: 22, Extents: exts})
					require.ErrorIs(t, err, ErrBusy, "a quarantined destination was granted again")
				} else {
					require.False(t, g.Quarantined())
					select {
					case <-g.Done():
					default:
						t.Fatal("Revoke returned before Done with nothing to quarantine")
					}
				}

				require.NoError(t, syscall.Kill(pid, how.sig))
				select {
				case <-g.Done():
				case <-time.After(10 * time.Second):
					t.Fatal("the quarantine did not end")
				}
				snap := bytes.Clone(dst.Bytes())
				if how.sig == syscall.SIGKILL {
					_ = cmd.Wait()
				} else {
					done := make(chan error, 1)
					go func() { done <- cmd.Wait() }()
					select {
					case err := <-done:
						var ee *exec.ExitError
						if err != nil && !errors.As(err, &ee) {
							t.Fatalf("writer: %v", err)
						}
					case <-time.After(20 * time.Second):
						t.Fatal("the resumed writer did not finish")
					}
				}
				// Once its connections ended nothing of the writer's can land
				// (the shm writer's process is gone too).
				waitFor(t, "the receiver's connections from the writer end", func() bool { return writerConns(rx) == 0 })
				require.Zero(t, changedSince(snap, dst.Bytes()), "bytes landed after Done")
				if fenced {
					require.Equal(t, atRevoke, crc32Update(0, dst.Bytes()), "bytes landed after Revoke returned")
				}
				require.Zero(t, rx.Stats().QuarantinedBytes)
				g2, err := rx.OpenGrant(GrantSpec{RequestID: 23, Extents: exts})
				require.NoError(t, err, "the destination stayed out of use after the quarantine")
				g2.Revoke()
			})
		}
	}
}
