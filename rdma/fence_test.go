package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
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
	return n + cutSHMWriters(e)
}

// The receiver cuts a live writer's connection in the middle of a large
// write: once the grant settled, nothing more lands, whatever the writer
// still does; and the writer's verdict agrees with the grant's.
func TestConformanceReceiverCutsLiveWriter(t *testing.T) {
	for _, tr := range testTransports() {
		t.Run(string(tr), func(t *testing.T) {
			if tr == TransportInproc {
				t.Skip("an in-process writer has no connection to cut")
			}
			const size = 256 << 20
			bg := context.Background()
			rx, tx, dst, src := bigPair(t, tr, size, nil)
			g, err := rx.OpenGrant(GrantSpec{RequestID: 7, Extents: []Extent{{Region: dst.ID(), Length: size}}})
			require.NoError(t, err)
			w := make(chan error, 1)
			go func() {
				_, err := tx.Write(bg, rx.Descriptor(), g.Ticket(), []Extent{{Region: src.ID(), Length: size}})
				w <- err
			}()
			waitFor(t, "the first bytes land", func() bool { return dst.Bytes()[0] != canary })
			require.Positive(t, cutWriters(rx), "no connection to cut")
			ctx, cancel := context.WithTimeout(bg, 10*time.Second)
			defer cancel()
			_, gerr := g.Wait(ctx)
			require.NotErrorIs(t, gerr, context.DeadlineExceeded, "the grant never settled")
			snap := bytes.Clone(dst.Bytes())
			werr := <-w
			time.Sleep(5 * time.Millisecond)
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
// exchange's: nil exactly when its own grant committed.
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

				w1 := make(chan error, 1)
				go func() {
					_, err := tx.Write(bg, desc, g1.Ticket(), []Extent{{Region: src.ID(), Length: big}})
					w1 <- err
				}()
				waitFor(t, "W1 copies", func() bool { return dst.Bytes()[0] != canary })
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
				waitFor(t, "W1's copy ends", func() bool { return dst.Bytes()[big-1] != canary || len(w1) > 0 })
				time.Sleep(20 * time.Millisecond)
				revoked := make(chan struct{})
				if revoke == "own grant" {
					go func() { g1.Revoke(); close(revoked) }()
				} else {
					go func() { gA.Revoke(); close(revoked) }() // waits for the held commit
				}
				time.Sleep(20 * time.Millisecond)
				cancelA() // A's exchange is cut, its verdict still to come
				time.Sleep(50 * time.Millisecond)
				release()
				errA := <-wa
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
// old grant race: the new grant always takes its write.
func TestConformanceFenceVersusReuse(t *testing.T) {
	for _, tr := range testTransports() {
		t.Run(string(tr), func(t *testing.T) {
			bg := context.Background()
			rx, tx, dst, src := bigPair(t, tr, 1<<20, func(c *Config) { c.MaxGrants = 1 })
			rng := rand.New(rand.NewPCG(5, 6))
			ext := []Extent{{Region: dst.ID(), Offset: 0, Length: 256 << 10}}
			from := []Extent{{Region: src.ID(), Offset: 0, Length: 256 << 10}}
			for i := range 40 {
				g1, err := rx.OpenGrant(GrantSpec{RequestID: uint64(2*i + 1), Extents: ext})
				require.NoError(t, err)
				w := make(chan error, 1)
				go func() { _, err := tx.Write(bg, rx.Descriptor(), g1.Ticket(), from); w <- err }()
				time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
				g1.Revoke()
				<-w
				<-g1.Done()
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

// stop stops the process and waits until the kernel reports it stopped.
func stop(t *testing.T, pid int) {
	t.Helper()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	waitFor(t, "the writer stops", func() bool { return procState(pid) == 'T' })
}

// A writer process is stopped (SIGSTOP) in the middle of a write: Revoke
// returns within a bound and the grant fails at once. Where the stopped
// writer maps the destination (shm) and is inside a copy, the destination is
// quarantined: Done stays open, OpenGrant refuses the extents, the stats
// count the bytes, until the writer's copy ends (SIGCONT) or its process is
// gone (SIGKILL); nothing lands after Done either way.
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
				cmd, _ := startWriter(t, helperJob{Transport: tr, Peer: rx.Descriptor(), Ticket: g.Ticket()})
				pid := cmd.Process.Pid
				defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
				waitFor(t, "the first bytes land", func() bool { return dst.Bytes()[0] != canary })

				// Stop it; with shm, until it is caught inside a copy bracket.
				inside := func() bool { return false }
				if tr == TransportSHM {
					inside = shmWriting(rx, g)
				}
				stop(t, pid)
				for try := 0; tr == TransportSHM && !inside(); try++ {
					require.Less(t, try, 500, "never caught the writer inside a copy")
					select {
					case <-g.Done():
						t.Fatal("the write finished before the writer was caught inside a copy")
					default:
					}
					require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
					time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
					stop(t, pid)
				}

				start := time.Now()
				g.Revoke()
				took := time.Since(start)
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
				time.Sleep(5 * time.Millisecond)
				require.Zero(t, changedSince(snap, dst.Bytes()), "bytes landed after Done")
				require.Zero(t, rx.Stats().QuarantinedBytes)
				g2, err := rx.OpenGrant(GrantSpec{RequestID: 23, Extents: exts})
				require.NoError(t, err, "the destination stayed out of use after the quarantine")
				g2.Revoke()
			})
		}
	}
}
