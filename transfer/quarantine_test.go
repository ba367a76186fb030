//go:build linux

package transfer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

// writerJob is what the stoppable writer process is told: where to write.
type writerJob struct {
	Peer   rdma.Descriptor `json:"peer"`
	Ticket rdma.Ticket     `json:"ticket"`
}

// TestHelperStoppableWriter is a prefill writer in a process of its own
// (this test binary, re-executed), so that the test can stop it with
// SIGSTOP in the middle of a shm copy. It does nothing in a normal run.
func TestHelperStoppableWriter(t *testing.T) {
	raw := os.Getenv("TRANSFER_WRITER_JOB")
	if raw == "" {
		t.Skip("helper process for TestHandoffQuarantinedWhileWriterStopped")
	}
	var job writerJob
	require.NoError(t, json.Unmarshal([]byte(raw), &job))
	e, err := rdma.New(rdma.Config{Agent: "stoppable-writer", Transports: []rdma.Transport{rdma.TransportSHM}, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer e.Close()
	src, err := e.Register("src", int64(job.Ticket.Bytes))
	require.NoError(t, err)
	b := src.Bytes()
	b[0] = 0x5A
	for n := 1; n < len(b); n *= 2 {
		copy(b[n:], b[:n])
	}
	_, err = e.Connect(context.Background(), job.Peer)
	require.NoError(t, err)
	fmt.Println("connected")
	_, err = e.Write(context.Background(), job.Peer, job.Ticket, []rdma.Extent{{Region: src.ID(), Length: job.Ticket.Bytes}})
	fmt.Println("write:", err)
}

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

// A prefill writer process is stopped (SIGSTOP) while it copies into the
// decoder's destination over shm, and the handoff is cancelled. The handoff
// returns at once with a *QuarantinedError, and the request's blocks and
// row stay allocated while the stopped writer could still store into them;
// once it resumed and ended its copy, Released closes and they are freed.
func TestHandoffQuarantinedWhileWriterStopped(t *testing.T) {
	quarantineRun(t, func(_ *nats.Msg, _ wire.PrefillRequest, cancel func()) { cancel() }, ErrCancelled)
}

// As above, but the handoff is retried rather than cancelled: the serving
// instance replies peer_failed, so the session revokes its grant and opens
// a fresh one over the same destination. With the revoked grant
// quarantined, a writer stopped inside a copy could still store into the
// new attempt's bytes after their commit was verified. The data plane
// refuses the fresh grant (it overlaps the quarantined grant, still open),
// so the handoff fails instead, quarantined, and no second attempt is sent.
func TestHandoffQuarantinedNotRetried(t *testing.T) {
	quarantineRun(t, func(m *nats.Msg, r wire.PrefillRequest, _ func()) {
		b, err := wire.EncodePrefillReply(wire.PrefillReply{V: wire.WireVersion, RequestID: r.RequestID, Instance: "p1",
			Code: session.CodePeerFailed, Msg: "write failed"}, 1<<20)
		require.NoError(t, err)
		require.NoError(t, m.Respond(b))
	}, ErrPeerFailed)
}

// quarantineRun stops a writer process inside a shm copy into a handoff's
// destination, ends the handoff's attempt with end (given the request's
// message), and checks the handoff fails with want, quarantined, until the
// writer resumed.
func quarantineRun(t *testing.T, end func(m *nats.Msg, r wire.PrefillRequest, cancel func()), want error) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	f := newFixture(t)
	// 512 KiB KV blocks: a request of 8192 tokens moves 256 MiB, so the
	// writer spends most of its time inside copy brackets.
	cfg := hybrid.Config{
		KV: kvcache.Config{Layers: 8, KVHeads: 8, HeadDim: 128, ElemSize: 2, TokensPerBlock: 16, Blocks: 600},
		Mamba: mambacache.Config{Layers: 2, DState: 4, DConv: 4, Heads: 2, HeadDim: 3, NGroups: 1,
			ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 2, AttentionDP: true, MaxDraftTokens: 2},
	}
	ds := newSideOn(t, "dec", cfg, rdma.TransportSHM)
	d := f.decoder("d1", ds, nil)
	nc := natstest.Connect(t, f.srv)
	type received struct {
		m *nats.Msg
		r wire.PrefillRequest
	}
	reqs := make(chan received, 4)
	sub, err := nc.Subscribe(wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectPrefill, ""), func(m *nats.Msg) {
		if r, err := wire.DecodePrefillRequest(m.Data); err == nil {
			reqs <- received{m, r}
		}
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	require.NoError(t, nc.Flush())

	for attempt := uint64(1); attempt <= 8; attempt++ {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			_, err := ds.handoff(ctx, d, Request{ID: attempt, Tokens: tokens(8192), Deadline: time.Now().Add(time.Minute)})
			done <- err
		}()
		in := <-reqs
		r := in.r
		raw, err := json.Marshal(writerJob{Peer: ds.eng.Descriptor(), Ticket: r.Ticket})
		require.NoError(t, err)
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperStoppableWriter$", "-test.v")
		cmd.Env = append(os.Environ(), "TRANSFER_WRITER_JOB="+string(raw))
		out, err := cmd.StdoutPipe()
		require.NoError(t, err)
		cmd.Stderr = os.Stderr
		require.NoError(t, cmd.Start())
		sc := bufio.NewScanner(out)
		for sc.Scan() && !strings.HasPrefix(sc.Text(), "connected") {
		}
		first := ds.bytes(r.Ticket.Extents[0])
		landed := time.Now().Add(10 * time.Second)
		for first[0] != 0x5A && time.Now().Before(landed) {
			time.Sleep(20 * time.Microsecond)
		}
		require.Equal(t, byte(0x5A), first[0], "nothing landed in 10s")
		pid := cmd.Process.Pid
		require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
		for procState(pid) != 'T' {
			time.Sleep(50 * time.Microsecond)
		}

		start := time.Now()
		q0 := ds.eng.Stats().GrantsQuarantined
		end(in.m, r, cancel)
		var herr error
		select {
		case herr = <-done:
		case again := <-reqs:
			// Retried: only right when the revoked grant was not
			// quarantined (the writer stopped between two copies).
			require.Equal(t, q0, ds.eng.Stats().GrantsQuarantined,
				"attempt %d was sent over a quarantined destination", again.r.Attempt)
			cancel()
			<-done
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			ds.requireInitial(t)
			continue
		case <-time.After(5 * time.Second):
			t.Fatal("the handoff waited for a stopped writer")
		}
		t.Logf("attempt %d: the handoff returned after %s: %v", attempt, time.Since(start), herr)
		cancel()
		require.ErrorIs(t, herr, want)
		var qe *QuarantinedError
		if !errors.As(herr, &qe) {
			// Stopped between two copies: nothing to quarantine.
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			ds.requireInitial(t)
			continue
		}
		select {
		case again := <-reqs:
			t.Fatalf("attempt %d was sent over the quarantined destination", again.r.Attempt)
		case <-time.After(50 * time.Millisecond):
		}
		require.NotEqual(t, ds.initial, ds.m.Stats(), "the quarantined blocks and row went back to the pools")
		select {
		case <-qe.Released():
			t.Fatal("Released closed while the writer is stopped inside a copy")
		default:
		}
		require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		select {
		case <-qe.Released():
		case <-time.After(10 * time.Second):
			t.Fatal("the quarantine did not end after the writer resumed")
		}
		ds.requireInitial(t)
		for sc.Scan() {
			t.Logf("writer: %s", sc.Text())
		}
		require.NoError(t, cmd.Wait())
		return
	}
	t.Fatal("the writer was never stopped inside a copy")
}
