package transfer_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/nats-io/nats.go"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/rdma"
	"github.com/handoff-io/handoff/transfer"
)

// oneRow is a PrefillExecutor whose "prefill" fills a 16-byte state row.
type oneRow struct{ src *rdma.Region }

func (x oneRow) Admit(job transfer.Job) (transfer.AdmittedJob, error) { return x, nil }

func (x oneRow) Prefill(ctx context.Context) (transfer.Prefilled, error) {
	copy(x.src.Bytes(), "state of request")
	return transfer.Prefilled{FirstToken: 42, Source: transfer.CacheExtents{
		Mamba: rdma.Extent{Region: x.src.ID(), Length: 16}}}, nil
}

func (oneRow) Release() {}

// Example runs one handoff between a prefill worker and a decode worker in
// one process: embedded NATS for control, in-process data path.
func Example() {
	dir, _ := os.MkdirTemp("", "example")
	defer os.RemoveAll(dir)
	srv, err := natstest.Start(natstest.Options(dir))
	if err != nil {
		panic(err)
	}
	defer srv.Shutdown()
	quiet := slog.New(slog.DiscardHandler)
	engine := func(agent string) (*rdma.Engine, *rdma.Region) {
		e, err := rdma.New(rdma.Config{Agent: rdma.AgentID(agent), Transports: []rdma.Transport{rdma.TransportInproc}, Logger: quiet})
		if err != nil {
			panic(err)
		}
		r, err := e.Register("state", 4096)
		if err != nil {
			panic(err)
		}
		return e, r
	}
	preEng, preRegion := engine("prefill-0")
	defer preEng.Close()
	decEng, decRegion := engine("decode-0")
	defer decEng.Close()
	preNC, _ := nats.Connect(srv.ClientURL())
	defer preNC.Close()
	decNC, _ := nats.Connect(srv.ClientURL())
	defer decNC.Close()

	ctx := context.Background()
	p, err := transfer.NewPrefiller(transfer.PrefillerConfig{Instance: "prefill-0", Namespace: "demo", Fingerprint: "model-a"},
		preNC, preEng, oneRow{src: preRegion})
	if err != nil {
		panic(err)
	}
	if err := p.Start(ctx); err != nil {
		panic(err)
	}
	defer p.Shutdown(ctx)
	d, err := transfer.NewDecoder(ctx, transfer.DecoderConfig{Instance: "decode-0", Namespace: "demo", Fingerprint: "model-a"},
		decNC, decEng)
	if err != nil {
		panic(err)
	}
	defer d.Close()

	dest := transfer.CacheExtents{Mamba: rdma.Extent{Region: decRegion.ID(), Offset: 64, Length: 16}}
	res, err := d.Handoff(ctx, transfer.Request{ID: 1, Tokens: []int32{1, 2, 3}, Dest: dest})
	if err != nil {
		panic(err)
	}
	fmt.Println(res.FirstToken, res.Instance, res.MambaBytes, string(decRegion.Bytes()[64:80]))

	_, err = d.Handoff(ctx, transfer.Request{ID: 0, Tokens: []int32{1}, Dest: dest})
	fmt.Println(err)
	// Output:
	// 42 prefill-0 16 state of request
	// transfer: request 0: transfer: dummy request cannot be transferred
}
