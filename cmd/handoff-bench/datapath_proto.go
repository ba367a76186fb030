package main

// The datapath bench runs a receiver and a writer, by default in two
// processes. They talk over a control channel: the receiver's stdin and
// stdout when it is a child process, an io.Pipe pair when it is a goroutine.
// Messages are JSON, one per line:
//
//	receiver -> writer  hello   {descriptor}                 once, first
//	writer -> receiver  open    {stream, slot, request_id}   open a grant over that slot
//	receiver -> writer  ticket  {stream, slot, ticket}       the grant's ticket, extents left out
//	writer -> receiver  stop    {}                           no more opens; report
//	receiver -> writer  stats   {committed, bytes, unused}   then the receiver exits
//	receiver -> writer  error   {error}                      the receiver gave up
//
// Both sides derive a slot's extents from the layout (the flags the child
// was started with), so a ticket carries only the grant's identity, which
// keeps the control traffic small next to the data it sets up.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/handoff-io/handoff/rdma"
)

// layout is how grants map onto the receiver's region and the writer's
// source region. A grant covers one slot: PerGrant extents of Extent bytes,
// each followed by a gap of the same size so that no two extents are
// adjacent. Each stream owns Depth slots, so Depth grants per stream can be
// open at once (the next ticket is fetched while the current one is written).
type layout struct {
	Extent   uint64 // bytes per extent
	PerGrant int    // extents per grant
	Streams  int
	Depth    int
	// Engine settings of the run, the same on both sides.
	TCPLanes int           // rdma.Config.TCPLanes (0: the engine's default)
	SkipCRC  bool          // rdma.Config.SkipCRC
	GrantTTL time.Duration // each grant's deadline after its opening (0: grantTTL)
	TLSDir   string        // with tcp: mutual TLS from the certificates here (--tls)
}

func newLayout(extent, grantBytes uint64, streams, depth int) (layout, error) {
	switch {
	case extent == 0:
		return layout{}, errors.New("extent must be > 0")
	case streams < 1 || streams > 64:
		return layout{}, fmt.Errorf("streams %d: want 1..64", streams)
	case depth < 1 || depth > 16:
		return layout{}, fmt.Errorf("depth %d: want 1..16", depth)
	case grantBytes > 1<<32:
		return layout{}, fmt.Errorf("grant bytes %d: at most 4GiB", grantBytes)
	}
	per := max(1, grantBytes/extent)
	l := layout{Extent: extent, PerGrant: int(per), Streams: streams, Depth: depth}
	if l.regionBytes() > 16<<30 {
		return layout{}, fmt.Errorf("layout needs %d bytes of destination memory; lower --grant-bytes, --streams or --depth", l.regionBytes())
	}
	return l, nil
}

func (l layout) grantBytes() uint64 { return l.Extent * uint64(l.PerGrant) }

// ttl is the deadline of each grant after its opening, which also bounds
// every wait of the writer for the receiver.
func (l layout) ttl() time.Duration {
	if l.GrantTTL > 0 {
		return l.GrantTTL
	}
	return grantTTL
}

func (l layout) span() uint64 { return 2 * l.grantBytes() }
func (l layout) slots() int   { return l.Streams * l.Depth }

// regionBytes is the receiver's destination region size.
func (l layout) regionBytes() uint64 { return uint64(l.slots()) * l.span() }

// sourceBytes is the writer's source region size: one slot per stream.
func (l layout) sourceBytes() uint64 { return uint64(l.Streams) * l.span() }

// extents lists the strided extents of the index'th span of region.
func (l layout) extents(region rdma.RegionID, index int) []rdma.Extent {
	base := uint64(index) * l.span()
	xs := make([]rdma.Extent, l.PerGrant)
	for i := range xs {
		xs[i] = rdma.Extent{Region: region, Offset: base + uint64(i)*2*l.Extent, Length: l.Extent}
	}
	return xs
}

func (l layout) slotIndex(stream, slot int) (int, error) {
	if stream < 0 || stream >= l.Streams || slot < 0 || slot >= l.Depth {
		return 0, fmt.Errorf("slot (%d,%d) outside %d streams x %d slots", stream, slot, l.Streams, l.Depth)
	}
	return stream*l.Depth + slot, nil
}

// wireTicket is a Ticket without its extents.
type wireTicket struct {
	Grant     uint64    `json:"grant"`
	Epoch     uint64    `json:"epoch"`
	Token     [16]byte  `json:"token"`
	RequestID uint64    `json:"request_id"`
	Bytes     uint64    `json:"bytes"`
	Deadline  time.Time `json:"deadline"`
}

type ctrlMsg struct {
	Type       string           `json:"type"`
	Descriptor *rdma.Descriptor `json:"descriptor,omitempty"`
	Stream     int              `json:"stream,omitempty"`
	Slot       int              `json:"slot,omitempty"`
	RequestID  uint64           `json:"request_id,omitempty"`
	Ticket     *wireTicket      `json:"ticket,omitempty"`
	Stats      *receiverStats   `json:"stats,omitempty"`
	Error      string           `json:"error,omitempty"`
}

// receiverStats is what the receiver saw: grants whose commit it accepted and
// their bytes, and grants it revoked unused at stop.
type receiverStats struct {
	Committed uint64 `json:"committed"`
	Bytes     uint64 `json:"bytes"`
	Unused    uint64 `json:"unused"`
}

// maxCtrlLine bounds one control message; a hello with a long descriptor is
// the largest.
const maxCtrlLine = 1 << 20

// ctrlReader decodes one message per line.
type ctrlReader struct{ sc *bufio.Scanner }

func newCtrlReader(r io.Reader) *ctrlReader {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxCtrlLine)
	return &ctrlReader{sc: sc}
}

// next returns the next message; io.EOF when the peer closed cleanly between
// messages, io.ErrUnexpectedEOF inside one.
func (c *ctrlReader) next() (ctrlMsg, error) {
	if !c.sc.Scan() {
		if err := c.sc.Err(); err != nil {
			return ctrlMsg{}, fmt.Errorf("control channel: %w", err)
		}
		return ctrlMsg{}, io.EOF
	}
	return decodeCtrl(c.sc.Bytes())
}

func decodeCtrl(line []byte) (ctrlMsg, error) {
	var m ctrlMsg
	if err := json.Unmarshal(line, &m); err != nil {
		return ctrlMsg{}, fmt.Errorf("control channel: bad message: %w", err)
	}
	switch m.Type {
	case "hello":
		if m.Descriptor == nil {
			return ctrlMsg{}, errors.New("control channel: hello without descriptor")
		}
	case "ticket":
		if m.Ticket == nil {
			return ctrlMsg{}, errors.New("control channel: ticket message without ticket")
		}
	case "stats":
		if m.Stats == nil {
			return ctrlMsg{}, errors.New("control channel: stats message without stats")
		}
	case "open", "stop", "error":
	default:
		return ctrlMsg{}, fmt.Errorf("control channel: unknown message type %q", m.Type)
	}
	return m, nil
}

// ctrlWriter encodes messages; safe for concurrent use.
type ctrlWriter struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func newCtrlWriter(w io.Writer) *ctrlWriter { return &ctrlWriter{enc: json.NewEncoder(w)} }

func (c *ctrlWriter) send(m ctrlMsg) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.enc.Encode(m); err != nil {
		return fmt.Errorf("control channel: %w", err)
	}
	return nil
}

// receiverConfig is what a receiver needs besides its control channel.
type receiverConfig struct {
	Transport rdma.Transport
	Layout    layout
	Logger    *slog.Logger
	GrantTTL  time.Duration // deadline of each grant
}

// serveReceiver runs the receiving side until the writer says stop, the
// channel closes, or ctx ends (at once, even while it waits for the writer).
// It owns its engine and closes it on return.
func serveReceiver(ctx context.Context, cfg receiverConfig, in io.Reader, out io.Writer) (err error) {
	w := newCtrlWriter(out)
	defer func() {
		if err != nil {
			_ = w.send(ctrlMsg{Type: "error", Error: err.Error()})
		}
	}()
	tlsCfg, err := loadBenchTLS(cfg.Layout.TLSDir)
	if err != nil {
		return err
	}
	eng, err := rdma.New(rdma.Config{
		Agent:      agentID("receiver"),
		Transports: []rdma.Transport{cfg.Transport},
		Logger:     cfg.Logger,
		MaxGrants:  cfg.Layout.slots() + 1,
		SkipCRC:    cfg.Layout.SkipCRC,
		TLS:        tlsCfg,
	})
	if err != nil {
		return err
	}
	defer eng.Close()
	reg, err := eng.Register("bench-dst", int64(cfg.Layout.regionBytes()))
	if err != nil {
		return err
	}
	slots := make([][]rdma.Extent, cfg.Layout.slots())
	for i := range slots {
		slots[i] = cfg.Layout.extents(reg.ID(), i)
	}
	grants := make([]*rdma.Grant, len(slots))
	var stats receiverStats
	// settle accounts for the previous grant of a slot before it is reused.
	settle := func(g *rdma.Grant) error {
		wctx, cancel := context.WithTimeout(ctx, cfg.GrantTTL)
		defer cancel()
		m, err := g.Wait(wctx)
		if err != nil {
			return fmt.Errorf("grant %d: %w", g.ID(), err)
		}
		stats.Committed++
		for _, b := range m.Bytes {
			stats.Bytes += b
		}
		return nil
	}
	d := eng.Descriptor()
	if err := w.send(ctrlMsg{Type: "hello", Descriptor: &d}); err != nil {
		return err
	}
	// The channel is read on a goroutine of its own, so that an end of ctx
	// is seen while a read blocks (a read of stdin cannot be interrupted).
	type next struct {
		m   ctrlMsg
		err error
	}
	msgs := make(chan next)
	done := make(chan struct{})
	defer close(done)
	go func() {
		r := newCtrlReader(in)
		for {
			m, err := r.next()
			select {
			case msgs <- next{m, err}:
			case <-done:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	for {
		var m ctrlMsg
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case n := <-msgs:
			m, err = n.m, n.err
		}
		if errors.Is(err, io.EOF) {
			return errors.New("control channel closed before stop")
		}
		if err != nil {
			return err
		}
		switch m.Type {
		case "open":
			i, err := cfg.Layout.slotIndex(m.Stream, m.Slot)
			if err != nil {
				return err
			}
			if g := grants[i]; g != nil {
				if err := settle(g); err != nil {
					return err
				}
			}
			g, err := eng.OpenGrant(rdma.GrantSpec{RequestID: m.RequestID, Extents: slots[i], Deadline: time.Now().Add(cfg.GrantTTL)})
			if err != nil {
				return err
			}
			grants[i] = g
			t := g.Ticket()
			wt := wireTicket{Grant: t.Grant, Epoch: t.Epoch, Token: t.Token, RequestID: t.RequestID, Bytes: t.Bytes, Deadline: t.Deadline}
			if err := w.send(ctrlMsg{Type: "ticket", Stream: m.Stream, Slot: m.Slot, Ticket: &wt}); err != nil {
				return err
			}
		case "stop":
			// Every write the writer issued has returned, so a written grant
			// is settled; the rest were fetched ahead and never used.
			for _, g := range grants {
				if g == nil {
					continue
				}
				select {
				case <-g.Done():
					if err := settle(g); err != nil {
						return err
					}
				default:
					g.Revoke()
					stats.Unused++
				}
			}
			return w.send(ctrlMsg{Type: "stats", Stats: &stats})
		default:
			return fmt.Errorf("control channel: unexpected %q from writer", m.Type)
		}
	}
}
