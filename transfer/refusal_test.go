package transfer

// Handoffs refused by name before any byte moves, or retried elsewhere:
// no worker, capacity, layout, payload size, dummies and reserved rows, and
// the one sentinel every failure matches.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/transfer/wire"
)

func TestHandoffNoPrefillWorker(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	d := f.decoder("d1", ds, func(c *DecoderConfig) { c.NoResponderWait = 300 * time.Millisecond })
	start := time.Now()
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrNoPrefillWorker)
	require.Less(t, time.Since(start), 5*time.Second, "waited past NoResponderWait")
	ds.requireInitial(t)
	// Sent at 0, 50 and 150 ms; the next (350 ms) is past the wait.
	require.Equal(t, uint64(2), d.Stats().Retries)
}

func TestHandoffCapacityRefused(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.refuse.Store(true)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrCapacityRefused)
	var re *RemoteError
	require.ErrorAs(t, err, &re)
	require.Equal(t, "p1", re.Instance)
	require.Equal(t, int64(3), x.admits.Load())
	ds.requireInitial(t)
	ps.requireInitial(t)
}

// TestHandoffTooLong: a request every worker refuses as longer than its
// pools fails matching ErrTooLong (not worth retrying) as well as
// ErrCapacityRefused; a larger worker serves it; and one worker merely
// full keeps the failure a plain capacity refusal, which may pass.
func TestHandoffTooLong(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	small, big := newExec(newSide(t, "pre1", testHybrid(64, 8))), newExec(newSide(t, "pre2", testHybrid(64, 8)))
	small.tooLong.Store(true)
	f.prefiller("p1", f.fp, small, withRegistryP)
	d := f.decoder("d1", ds, withRegistry)
	waitKnown(t, d.Registry(), wire.RolePrefill, 1)
	_, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrTooLong)
	require.ErrorIs(t, err, ErrCapacityRefused)
	ds.requireInitial(t)

	f.prefiller("p2", f.fp, big, withRegistryP)
	waitKnown(t, d.Registry(), wire.RolePrefill, 2)
	for id := uint64(2); id <= 9; id++ {
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(9)})
		require.NoError(t, err)
		require.Equal(t, "p2", res.Instance)
		require.NoError(t, ds.m.Free(id))
	}

	big.refuse.Store(true) // full now, not too small
	for id := uint64(10); id <= 13; id++ {
		_, err = ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(9)})
		require.ErrorIs(t, err, ErrCapacityRefused)
		require.NotErrorIs(t, err, ErrTooLong, "a worker only full may take it later")
	}
	ds.requireInitial(t)
}

// TestHandoffTooLongAfterAnAdmission: a worker that admitted the request
// (and then failed it: its drain ran out) holds it, so the small worker's
// refusals that follow do not make it too long: a capacity refusal, which
// may pass, not ErrTooLong.
func TestHandoffTooLongAfterAnAdmission(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	small, big := newExec(newSide(t, "pre1", testHybrid(64, 8))), newExec(newSide(t, "pre2", testHybrid(64, 8)))
	small.tooLong.Store(true)
	big.block = make(chan struct{})
	pBig := f.prefiller("p2", f.fp, big, withRegistryP)
	d := f.decoder("d1", ds, func(c *DecoderConfig) { withRegistry(c); c.DirectFirst = true })
	waitKnown(t, d.Registry(), wire.RolePrefill, 1)
	done := make(chan error, 1)
	go func() {
		_, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(time.Minute)})
		done <- err
	}()
	<-big.started
	f.prefiller("p1", f.fp, small, withRegistryP)
	waitKnown(t, d.Registry(), wire.RolePrefill, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	require.NoError(t, pBig.Shutdown(ctx)) // replies closed: retried on p1, which refuses it as too long
	err := <-done
	// The last attempt, with both instances excluded, goes to the queue
	// group; when p2's registry entry goes while it is out, p2's death is
	// taken as the serving instance's (session.RecvSession's EvPeerDied)
	// and the handoff ends peer failed instead: either way not too long.
	if !errors.Is(err, ErrPeerFailed) {
		require.ErrorIs(t, err, ErrCapacityRefused)
	}
	require.NotErrorIs(t, err, ErrTooLong, "p2 admitted it")
	require.Positive(t, small.admits.Load())
	ds.requireInitial(t)
}

// TestHandoffRetriesOnAnotherWorker: a full worker refuses; the retry goes to
// the other worker by its instance subject.
func TestHandoffRetriesOnAnotherWorker(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	full, free := newExec(newSide(t, "pre1", testHybrid(64, 8))), newExec(newSide(t, "pre2", testHybrid(64, 8)))
	full.refuse.Store(true)
	f.prefiller("p1", f.fp, full, withRegistryP)
	f.prefiller("p2", f.fp, free, withRegistryP)
	d := f.decoder("d1", ds, withRegistry)
	waitKnown(t, d.Registry(), wire.RolePrefill, 2)
	for id := uint64(1); id <= 16; id++ {
		res, err := ds.handoff(context.Background(), d, Request{ID: id, Tokens: tokens(5)})
		require.NoError(t, err)
		require.Equal(t, "p2", res.Instance)
		require.LessOrEqual(t, res.Attempts, 2)
		require.NoError(t, ds.m.Free(id))
	}
	require.Positive(t, full.admits.Load(), "the queue group never chose the full worker")
	ds.requireInitial(t)
	free.s.requireInitial(t)
}

func TestHandoffLayoutMismatch(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", "fp-other-model", x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrLayoutMismatch)
	require.ErrorContains(t, err, "layout")
	require.Zero(t, x.admits.Load(), "admitted despite the mismatch")
	ds.requireInitial(t)
	for _, r := range ds.regions {
		require.Equal(t, make([]byte, r.Len()), r.Bytes(), "a byte moved")
	}
}

// TestHandoffLayoutMismatchBytes: same fingerprint, but the worker's cache of
// the prompt has another size (misconfigured block size): refused after
// prefill, before any byte moves.
func TestHandoffLayoutMismatchBytes(t *testing.T) {
	f := newFixture(t)
	other := testHybrid(64, 8)
	other.KV.TokensPerBlock = 8
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", other)
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrLayoutMismatch)
	ds.requireInitial(t)
	ps.requireInitial(t)
	for _, r := range ds.regions {
		require.Equal(t, make([]byte, r.Len()), r.Bytes(), "a byte moved")
	}
}

func TestHandoffPayloadTooLarge(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(1<<16+2, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)
	before := inMsgs(t, f.srv)
	_, err := ds.handoff(context.Background(), d, Request{ID: 3, Tokens: tokens(wire.DefaultMaxPayload / 4)})
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	require.Equal(t, before, inMsgs(t, f.srv), "something was published")
	require.Zero(t, x.admits.Load())
	ds.requireInitial(t)
}

// TestDummiesNeverTransferred: request id 0 and padding sentinels are refused
// by the decoder before granting and by the worker before admitting; a
// reserved row cannot be resolved nor granted.
func TestDummiesNeverTransferred(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	d := f.decoder("d1", ds, nil)
	f.prefiller("p1", f.fp, x, nil)

	// A destination a broken caller might pass along with a dummy id.
	dest, err := ds.prepare(1, 4)
	require.NoError(t, err)
	for _, id := range []uint64{0, math.MaxUint64, math.MaxUint64 - 2} {
		_, err := d.Handoff(context.Background(), Request{ID: id, Tokens: tokens(4), Dest: dest})
		require.ErrorIs(t, err, ErrDummyRequest, "id %d", id)
	}
	require.Zero(t, ds.eng.Stats().GrantsOpened)
	require.NoError(t, ds.m.Free(1))

	// The worker refuses a request naming a dummy id, whoever sent it.
	nc := natstest.Connect(t, f.srv)
	for _, id := range []uint64{0, math.MaxUint64 - 1} {
		req := wire.PrefillRequest{RequestID: id, Fingerprint: f.fp, Tokens: tokens(4),
			Deadline:   time.Now().Add(time.Minute).UnixNano(),
			Ticket:     rdma.Ticket{RequestID: id, Extents: []rdma.Extent{{Region: 1, Length: 4096}}, Bytes: 4096},
			MambaBytes: 4096}
		b, err := wire.EncodePrefillRequest(req, 0)
		require.NoError(t, err)
		m, err := nc.Request(wire.Subject(wire.DefaultPrefix, f.ns, wire.SubjectPrefill, ""), b, 5*time.Second)
		require.NoError(t, err)
		rep, err := wire.DecodePrefillReply(m.Data)
		require.NoError(t, err)
		require.Equal(t, session.CodeDummyRequest, rep.Code, "id %d", id)
	}
	require.Zero(t, x.admits.Load())

	// Reserved rows: the ADP dummy's row can be neither resolved nor granted.
	require.NoError(t, ds.m.AddDummy(mambacache.ADPDummyID))
	row, ok := ds.m.Mamba().Row(mambacache.ADPDummyID)
	require.True(t, ok)
	require.True(t, ds.m.Mamba().IsReserved(row))
	_, err = ds.rank.Resolve(hybrid.Resources{Row: row})
	require.ErrorIs(t, err, ErrDummyRequest)
	x0 := ds.m.Mamba().Config().RowExtent(row)
	var mambaRegion rdma.RegionID
	for id, r := range ds.regions {
		if r.Name() == "mamba" {
			mambaRegion = id
		}
	}
	_, err = ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 5, Extents: []rdma.Extent{{Region: mambaRegion, Offset: uint64(x0.Offset), Length: uint64(x0.Length)}}})
	require.ErrorIs(t, err, rdma.ErrForbidden)
	require.Equal(t, session.CodeDummyRequest, rdmaCode(err))
	require.NoError(t, ds.m.Free(mambacache.ADPDummyID))
	ds.requireInitial(t)
}

// badRowDest is a reserved row's extent, as a broken allocator might hand
// it out.
func badRowDest(s *side) CacheExtents {
	cfg := s.m.Mamba().Config()
	row := mambacache.Row(cfg.TotalRows() - 1) // the padding row
	x := cfg.RowExtent(row)
	var region rdma.RegionID
	for rid, r := range s.regions {
		if r.Name() == "mamba" {
			region = rid
		}
	}
	return CacheExtents{Mamba: rdma.Extent{Region: region, Offset: uint64(x.Offset), Length: uint64(x.Length)}}
}

func TestHandoffRefusesReservedRowGrant(t *testing.T) {
	f := newFixture(t)
	ds := newSide(t, "dec", testHybrid(64, 8))
	require.True(t, ds.m.Mamba().IsReserved(mambacache.Row(ds.m.Mamba().Config().TotalRows()-1)))
	d := f.decoder("d1", ds, nil)
	_, err := d.Handoff(context.Background(), Request{ID: 9, Tokens: tokens(4), Dest: badRowDest(ds)})
	require.ErrorIs(t, err, ErrDummyRequest)
	require.ErrorIs(t, err, rdma.ErrForbidden)
}

// TestFailureMatchesOneSentinel: whatever happened before, a Handoff error
// matches exactly one class.
func TestFailureMatchesOneSentinel(t *testing.T) {
	h := &handoff{req: Request{ID: 5}}
	cases := []struct {
		cause error
		code  session.Code
		also  error // a non-transfer error that must stay reachable
	}{
		{nil, session.CodeTimeout, nil},
		{&RemoteError{Code: session.CodeCapacityRefused}, session.CodeCapacityRefused, nil},
		{&RemoteError{Code: session.CodeCapacityRefused}, session.CodeNoPrefillWorker, nil},
		{fmt.Errorf("grant: %w", rdma.ErrForbidden), session.CodeDummyRequest, rdma.ErrForbidden},
		{context.Canceled, session.CodeCancelled, context.Canceled},
		{context.DeadlineExceeded, session.CodeTimeout, context.DeadlineExceeded},
	}
	for _, c := range cases {
		h.cause = c.cause
		err := h.failure(c.code)
		require.Equal(t, c.code, codeOf(err), "%v", err)
		for o := session.Code(1); o < session.NumCodes; o++ {
			require.Equal(t, o == c.code, errors.Is(err, codeErr(o)), "%v vs %s", err, o)
		}
		if c.also != nil {
			require.ErrorIs(t, err, c.also)
		}
	}
}

// TestHandoffRefusesCheckpointRowGrant: a state checkpoint row of the
// prefix cache is never a grant's destination nor a source: Resolve
// refuses it and the data plane forbids its bytes, as for reserved rows.
func TestHandoffRefusesCheckpointRowGrant(t *testing.T) {
	f := newFixture(t)
	cfg := testHybrid(64, 8)
	cfg.Mamba.CheckpointRows = 2
	ds := newSide(t, "dec", cfg)
	mc := ds.m.Mamba().Config()
	for _, row := range []mambacache.Row{mambacache.Row(mc.TotalRows()), mambacache.Row(mc.ArenaRows() - 1)} {
		require.True(t, mc.IsCheckpointRow(row))
		_, err := ds.rank.Resolve(hybrid.Resources{Row: row})
		require.ErrorIs(t, err, ErrDummyRequest, "row %d", row)
		_, err = ds.rank.Source(hybrid.Resources{Row: row}, 2)
		require.ErrorIs(t, err, ErrDummyRequest, "row %d", row)
	}
	d := f.decoder("d1", ds, nil)
	dest := badRowDest(ds)
	x := mc.RowExtent(mambacache.Row(mc.TotalRows()))
	dest.Mamba.Offset, dest.Mamba.Length = uint64(x.Offset), uint64(x.Length)
	_, err := d.Handoff(context.Background(), Request{ID: 9, Tokens: tokens(4), Dest: dest})
	require.ErrorIs(t, err, ErrDummyRequest)
	require.ErrorIs(t, err, rdma.ErrForbidden)
}

// TestHandoffRefusesNonRealRowGrant: with speculative decoding on, every
// row whose role is not real (the ADP row, a padding row of each reachable
// draft length, a checkpoint row, a verifying request's scratch row) is
// refused by Resolve and Source with its role named, and its bytes are
// forbidden at the data plane, so no grant can ship or receive it as a
// request's state (vllm#50153, lmcache#4984: scratch paired as state).
func TestHandoffRefusesNonRealRowGrant(t *testing.T) {
	f := newFixture(t)
	cfg := testHybrid(64, 4)
	cfg.Mamba.CheckpointRows = 1
	cfg.Mamba.DraftTokens = 2
	sched, err := mambacache.ParseDraftSchedule("1:2,2:1")
	require.NoError(t, err)
	cfg.Mamba.DraftLenSchedule = sched // batch 1 drafts 2, 2 drafts 1, 3..4 draft 0
	ds := newSide(t, "dec", cfg)
	mc := ds.m.Mamba().Config()
	// 4 real | adp | padding(2) padding(1) padding(0) | checkpoint | 4 scratch
	require.Equal(t, 4+1+3+1+4, mc.ArenaRows())
	var mambaRegion rdma.RegionID
	for id, r := range ds.regions {
		if r.Name() == "mamba" {
			mambaRegion = id
		}
	}
	kinds := map[mambacache.RowKind]int{}
	for r := range mc.ArenaRows() {
		row := mambacache.Row(r)
		role, ok := mc.RoleOf(row)
		require.True(t, ok)
		kinds[role.Kind]++
		_, rerr := ds.rank.Resolve(hybrid.Resources{Row: row})
		_, serr := ds.rank.Source(hybrid.Resources{Row: row}, 2)
		if role.Kind == mambacache.RowReal {
			require.NoError(t, rerr, "row %d", r)
			require.NoError(t, serr, "row %d", r)
			continue
		}
		for _, err := range []error{rerr, serr} {
			require.ErrorIs(t, err, ErrDummyRequest, "row %d (%s)", r, role)
			require.ErrorContains(t, err, "is a "+role.String()+" row", "row %d", r)
		}
		x := mc.RowExtent(row)
		_, err := ds.eng.OpenGrant(rdma.GrantSpec{RequestID: 5, Deadline: time.Now().Add(time.Minute),
			Extents: []rdma.Extent{{Region: mambaRegion, Offset: uint64(x.Offset), Length: uint64(x.Length)}}})
		require.ErrorIs(t, err, rdma.ErrForbidden, "row %d (%s)", r, role)
	}
	require.Equal(t, map[mambacache.RowKind]int{mambacache.RowReal: 4, mambacache.RowADP: 1,
		mambacache.RowPadding: 3, mambacache.RowCheckpoint: 1, mambacache.RowScratch: 4}, kinds)
	_, err = ds.rank.Resolve(hybrid.Resources{Row: mambacache.Row(mc.ArenaRows())})
	require.ErrorIs(t, err, ErrDummyRequest, "a row outside the arena")

	// A handoff whose destination is a scratch row is refused end to end.
	d := f.decoder("d1", ds, nil)
	dest := badRowDest(ds)
	scratch, ok := mc.ScratchRow(0)
	require.True(t, ok)
	x := mc.RowExtent(scratch)
	dest.Mamba.Offset, dest.Mamba.Length = uint64(x.Offset), uint64(x.Length)
	_, err = d.Handoff(context.Background(), Request{ID: 9, Tokens: tokens(4), Dest: dest})
	require.ErrorIs(t, err, ErrDummyRequest)
	require.ErrorIs(t, err, rdma.ErrForbidden)
}

// TestRefusalAfterAdmission: an executor whose prefill refuses a request it
// had admitted (a state from the cache evicted before its job ran) answers
// a capacity refusal, counted refused, not failed.
func TestRefusalAfterAdmission(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	x := newExec(ps)
	x.prefillErr = fmt.Errorf("%w: the state went from the cache", ErrCapacityRefused)
	p := f.prefiller("p1", f.fp, x, nil)
	d := f.decoder("d1", ds, nil)
	_, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9)})
	require.ErrorIs(t, err, ErrCapacityRefused)
	st := p.Stats()
	require.Positive(t, x.admits.Load())
	require.EqualValues(t, x.admits.Load(), st.Refused, "each attempt admitted, then refused: %+v", st)
	require.Zero(t, st.Failed, "%+v", st)
	ds.requireInitial(t)
}
