package rdma_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/handoff-io/handoff/rdma"
)

// A receiver (decode) opens a grant over two runs of its KV arena; a writer
// (prefill) writes one run of its own arena into them and commits.
func Example() {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()

	decode, err := rdma.New(rdma.Config{Agent: "decode-0", Transports: []rdma.Transport{rdma.TransportTCP}, Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer decode.Close()
	kv, _ := decode.Register("kv", 1<<20)
	kv.Forbid(0, 4096) // a reserved row: never grantable

	prefill, err := rdma.New(rdma.Config{Agent: "prefill-0", Transports: []rdma.Transport{rdma.TransportTCP}, Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer prefill.Close()
	src, _ := prefill.Register("kv", 1<<20)
	copy(src.Bytes(), "hello, decode")

	// Decode: open the grant and hand the ticket (plain data) to prefill.
	g, err := decode.OpenGrant(rdma.GrantSpec{
		RequestID: 42,
		Extents:   []rdma.Extent{{Region: kv.ID(), Offset: 8192, Length: 5}, {Region: kv.ID(), Offset: 16384, Length: 8}},
		Deadline:  time.Now().Add(5 * time.Second),
	})
	if err != nil {
		panic(err)
	}
	ticket, peer := g.Ticket(), decode.Descriptor()

	// Prefill: connect once at discovery, then write and commit.
	tr, _ := prefill.Connect(ctx, peer)
	if _, err := prefill.Write(ctx, peer, ticket, []rdma.Extent{{Region: src.ID(), Offset: 0, Length: 13}}); err != nil {
		panic(err)
	}

	// Decode: only a verified commit makes the request schedulable.
	m, err := g.Wait(ctx)
	fmt.Println(tr, err, m.Bytes)
	fmt.Printf("%s|%s\n", kv.Bytes()[8192:8197], kv.Bytes()[16384:16392])
	_, err = decode.OpenGrant(rdma.GrantSpec{RequestID: 43, Extents: []rdma.Extent{{Region: kv.ID(), Offset: 0, Length: 10}}})
	fmt.Println(err)
	// Output:
	// tcp <nil> [5 8]
	// hello|, decode
	// extent 0: rdma: extent overlaps a forbidden range: [0, 10) of region 1 overlaps forbidden [0, 4096)
}
