package agent

// The ticket: what a receiving agent hands its engine for the senders, and
// how it is encoded (msgpack, its extents folded where they repeat) and
// decoded by a sender. No IO.

import (
	"encoding/json"
	"fmt"
	"math"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/reshard"
)

// A ticket's version says how its extents are listed. Version 1 lists
// them in block order. Version 2 lists the KV pieces plane by plane
// (plans.planeMajor): a receiver with KV planes grants so. Version 3 is
// version 2 with the planes' extents folded (fold): one shape of extents
// and each plane's base, so a ticket naming thousands of scattered
// blocks of a many-layer model stays kilobytes, not megabytes. A sender
// that predates a version refuses it by name rather than writing in
// another order.
const (
	ticketPlaneMajor = 2
	ticketFolded     = 3
)

// foldFrom is the fewest extents a ticket folds: fewer fit a frame and an
// offer many times over as they are, and stay version 2, which senders
// that predate folding take.
const foldFrom = 1024

// ticket is what a receiving agent hands its engine for the senders: one
// rdma ticket per source shard that writes into this destination shard
// (reshard.go), the receiver's descriptor (so a sender needs no lookup),
// and what a sender checks before it writes a byte: the layout
// fingerprint, dtypes, both TP sizes, and how many blocks and whether a
// row.
type ticket struct {
	V           int        `msgpack:"v"`
	Agent       string     `msgpack:"agent"` // the agent's name (its rdma AgentID names one registration)
	Fingerprint string     `msgpack:"fp"`
	DTypes      string     `msgpack:"dtypes"`
	FromTP      int        `msgpack:"from_tp"`
	ToTP        int        `msgpack:"to_tp"`
	ToRank      int        `msgpack:"to_rank"`
	Blocks      int        `msgpack:"blocks"`
	Row         bool       `msgpack:"row"`
	Desc        []byte     `msgpack:"desc"` // rdma.Descriptor, JSON
	Subs        subTickets `msgpack:"subs"`
}

// subTickets are a ticket's grants, one per source shard: at most
// reshard.MaxTP, refused past that as they are decoded (msgpack's
// reflection would make room for any length a ticket claims, a few bytes
// of it per element).
type subTickets []subTicket

var _ msgpack.CustomDecoder = (*subTickets)(nil)

func (s *subTickets) DecodeMsgpack(d *msgpack.Decoder) error {
	return decodeBounded(d, (*[]subTicket)(s), reshard.MaxTP, func(n int) error {
		return fmt.Errorf("%d grants, more than TP %d has shards", n, reshard.MaxTP)
	})
}

type subTicket struct {
	Shard  int        `msgpack:"shard"`
	Ticket wireTicket `msgpack:"ticket"`
}

// wireTicket is an rdma.Ticket in msgpack: extents as flat (region,
// offset, length) triples, the deadline in Unix nanoseconds, so a ticket
// of thousands of extents decodes in microseconds. In a version-3 ticket
// the extents may begin with folded ones (fold): for each (region,
// offset) pair of Bases, each (offset, length) pair of Shape, at that
// offset from the base; Extents lists the rest.
type wireTicket struct {
	Agent     string `msgpack:"agent"`
	Grant     uint64 `msgpack:"grant"`
	Epoch     uint64 `msgpack:"epoch"`
	Token     []byte `msgpack:"token"`
	RequestID uint64 `msgpack:"request_id"`
	Shape     words  `msgpack:"shape,omitempty"`
	Bases     words  `msgpack:"bases,omitempty"`
	Extents   words  `msgpack:"extents"`
	Bytes     uint64 `msgpack:"bytes"`
	Deadline  int64  `msgpack:"deadline"`
}

// words is a msgpack array of unsigned integers, decoded without
// reflection (decodeInts): a ticket of a 512-block send carries 1,539 of
// them, on the send's path.
type words []uint64

var (
	_ msgpack.CustomEncoder = words(nil)
	_ msgpack.CustomDecoder = (*words)(nil)
)

// EncodeMsgpack writes each word in the fewest bytes that hold it
// (msgpack's default writes every uint64 in nine): a ticket's regions,
// lengths and offsets mostly fit in one to five.
func (w words) EncodeMsgpack(e *msgpack.Encoder) error {
	if err := e.EncodeArrayLen(len(w)); err != nil {
		return err
	}
	for _, v := range w {
		if err := e.EncodeUint(v); err != nil {
			return err
		}
	}
	return nil
}

func (w *words) DecodeMsgpack(d *msgpack.Decoder) (err error) {
	*w, err = decodeInts[uint64](d)
	return err
}

// toWire renders t, its leading extents folded in groups of g where they
// repeat one shape (fold; g 0 folds nothing). It says whether it folded.
func toWire(t rdma.Ticket, g int) (wireTicket, bool) {
	w := wireTicket{Agent: string(t.Agent), Grant: t.Grant, Epoch: t.Epoch, Token: t.Token[:], RequestID: t.RequestID, Bytes: t.Bytes}
	if !t.Deadline.IsZero() {
		w.Deadline = t.Deadline.UnixNano()
	}
	var rest []rdma.Extent
	w.Shape, w.Bases, rest = fold(t.Extents, g)
	w.Extents = make([]uint64, 0, 3*len(rest))
	for _, e := range rest {
		w.Extents = append(w.Extents, uint64(e.Region), e.Offset, e.Length)
	}
	return w, len(w.Bases) > 0
}

// fold finds the leading groups of g extents of es that repeat one shape:
// each group's extents in one region, at the same offsets from the
// group's lowest and of the same lengths. A plane-major ticket's groups
// are its planes, whose blocks a receiver lists alike. It returns the
// shape as (offset, length) pairs, each group's (region, lowest offset),
// and the extents after the groups; nothing folded unless two groups
// repeat.
func fold(es []rdma.Extent, g int) (shape, bases []uint64, rest []rdma.Extent) {
	if g < 1 || len(es) < 2*g {
		return nil, nil, es
	}
	lowest := func(grp []rdma.Extent) (uint64, bool) {
		lo := grp[0].Offset
		for _, e := range grp {
			if e.Region != grp[0].Region {
				return 0, false
			}
			lo = min(lo, e.Offset)
		}
		return lo, true
	}
	lo, ok := lowest(es[:g])
	if !ok {
		return nil, nil, es
	}
	shape = make([]uint64, 0, 2*g)
	for _, e := range es[:g] {
		shape = append(shape, e.Offset-lo, e.Length)
	}
	m := 0
	for ; (m+1)*g <= len(es); m++ {
		grp := es[m*g : (m+1)*g]
		lo, ok := lowest(grp)
		for i := 0; ok && i < g; i++ {
			ok = grp[i].Offset-lo == shape[2*i] && grp[i].Length == shape[2*i+1]
		}
		if !ok {
			break
		}
		bases = append(bases, uint64(grp[0].Region), lo)
	}
	if m < 2 {
		return nil, nil, es
	}
	return shape, bases, es[m*g:]
}

// ticket unfolds w into the rdma ticket it renders, refusing one of more
// than most extents before it makes room for them: a few bytes of shape
// and bases can claim millions.
func (w wireTicket) ticket(most int) (rdma.Ticket, error) {
	if len(w.Token) != 16 || len(w.Extents)%3 != 0 || len(w.Shape)%2 != 0 || len(w.Bases)%2 != 0 || (len(w.Shape) == 0) != (len(w.Bases) == 0) {
		return rdma.Ticket{}, fmt.Errorf("%w: token of %d bytes, %d extent words, %d shape words, %d base words", ErrBadTicket, len(w.Token), len(w.Extents), len(w.Shape), len(w.Bases))
	}
	n := len(w.Bases)/2*(len(w.Shape)/2) + len(w.Extents)/3
	if n > most {
		return rdma.Ticket{}, fmt.Errorf("%w: %d extents, at most %d", ErrBadTicket, n, most)
	}
	t := rdma.Ticket{Agent: rdma.AgentID(w.Agent), Grant: w.Grant, Epoch: w.Epoch, RequestID: w.RequestID, Bytes: w.Bytes,
		Extents: make([]rdma.Extent, 0, n)}
	copy(t.Token[:], w.Token)
	if w.Deadline != 0 {
		t.Deadline = time.Unix(0, w.Deadline)
	}
	for i := 0; i < len(w.Bases); i += 2 {
		if w.Bases[i] > math.MaxUint32 {
			return rdma.Ticket{}, fmt.Errorf("%w: region %d", ErrBadTicket, w.Bases[i])
		}
		for j := 0; j < len(w.Shape); j += 2 {
			off := w.Bases[i+1] + w.Shape[j]
			if off < w.Bases[i+1] {
				return rdma.Ticket{}, fmt.Errorf("%w: base %d plus offset %d overflows", ErrBadTicket, w.Bases[i+1], w.Shape[j])
			}
			t.Extents = append(t.Extents, rdma.Extent{Region: rdma.RegionID(w.Bases[i]), Offset: off, Length: w.Shape[j+1]})
		}
	}
	for i := 0; i < len(w.Extents); i += 3 {
		if w.Extents[i] > math.MaxUint32 {
			return rdma.Ticket{}, fmt.Errorf("%w: region %d", ErrBadTicket, w.Extents[i])
		}
		t.Extents = append(t.Extents, rdma.Extent{Region: rdma.RegionID(w.Extents[i]), Offset: w.Extents[i+1], Length: w.Extents[i+2]})
	}
	return t, nil
}

// encodeTicket renders a ticket as the bytes the engine carries: subs[i]
// is the rdma ticket of source shard shards[i], its extents folded in
// groups of groups[i] (fold) where t is plane-major and they are many
// (foldFrom), which makes it a version-3 ticket.
func encodeTicket(t ticket, d rdma.Descriptor, shards []int, subs []rdma.Ticket, groups []int) ([]byte, error) {
	var err error
	if t.Desc, err = json.Marshal(d); err != nil {
		return nil, fmt.Errorf("agent: encode descriptor: %w", err)
	}
	for i, rt := range subs {
		g := 0
		if (t.V == ticketPlaneMajor || t.V == ticketFolded) && len(rt.Extents) >= foldFrom {
			g = groups[i]
		}
		w, folded := toWire(rt, g)
		if folded {
			t.V = ticketFolded
		}
		t.Subs = append(t.Subs, subTicket{Shard: shards[i], Ticket: w})
	}
	return msgpack.Marshal(t)
}

// decodeTicket parses ticket bytes and returns the rdma ticket of source
// shard rank, still folded (nil when that shard writes nothing into it;
// wireTicket.ticket unfolds it). It checks the shape (version, TP sizes
// and ranks, each rdma ticket in the descriptor's agent), not the layout:
// the sender does that.
func decodeTicket(b []byte, rank int) (t ticket, d rdma.Descriptor, sub *wireTicket, err error) {
	fail := func(format string, args ...any) (ticket, rdma.Descriptor, *wireTicket, error) {
		return ticket{}, rdma.Descriptor{}, nil, fmt.Errorf("%w: "+format, append([]any{ErrBadTicket}, args...)...)
	}
	if err := unmarshal(b, &t); err != nil {
		return fail("%v", err)
	}
	switch {
	case t.V < 1 || t.V > ticketFolded:
		return fail("version %d", t.V)
	case t.FromTP < 1 || t.FromTP > reshard.MaxTP || t.ToTP < 1 || t.ToTP > reshard.MaxTP || t.ToRank < 0 || t.ToRank >= t.ToTP:
		return fail("TP %d → rank %d of %d", t.FromTP, t.ToRank, t.ToTP)
	case t.Blocks < 0 || (t.Blocks == 0 && !t.Row):
		return fail("%d blocks and row %v", t.Blocks, t.Row)
	case len(t.Subs) == 0 || len(t.Subs) > t.FromTP:
		return fail("%d grants for TP-%d senders", len(t.Subs), t.FromTP)
	}
	if err := json.Unmarshal(t.Desc, &d); err != nil {
		return fail("descriptor: %v", err)
	}
	seen := map[int]bool{}
	for i, s := range t.Subs {
		if s.Shard < 0 || s.Shard >= t.FromTP || seen[s.Shard] {
			return fail("a grant for source shard %d of %d", s.Shard, t.FromTP)
		}
		seen[s.Shard] = true
		if t.V != ticketFolded && len(s.Ticket.Shape)+len(s.Ticket.Bases) > 0 {
			return fail("folded extents in a version-%d ticket", t.V)
		}
		if s.Shard != rank {
			continue
		}
		if s.Ticket.Agent != string(d.Agent) {
			return fail("ticket of agent %q with the descriptor of %q", s.Ticket.Agent, d.Agent)
		}
		sub = &t.Subs[i].Ticket
	}
	return t, d, sub, nil
}
