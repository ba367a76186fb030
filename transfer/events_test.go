package transfer

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/kvcache"
	"github.com/handoff-io/handoff/kvevents"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/prefix"
	"github.com/handoff-io/handoff/transfer/wire"
)

const evTPB = 4

var evRoot = prefix.Salt("events-test")

func eventsManager(t *testing.T, blocks, cks int) *hybrid.Manager {
	t.Helper()
	m, err := hybrid.New(hybrid.Config{
		KV: kvcache.Config{Layers: 1, KVHeads: 1, HeadDim: 2, ElemSize: 2, TokensPerBlock: evTPB, Blocks: blocks},
		Mamba: mambacache.Config{Layers: 1, DState: 2, DConv: 2, Heads: 1, HeadDim: 2, NGroups: 1,
			ConvElemSize: 2, SSMElemSize: 4, MaxBatchSize: 2, CheckpointRows: cks},
	})
	require.NoError(t, err)
	return m
}

func evPrompt(tokens []int32) hybrid.Prompt {
	return hybrid.Prompt{Tokens: tokens, Root: evRoot, Chain: prefix.Chain(nil, evRoot, tokens, evTPB)}
}

// serveOn leaves in m what a prefill of tokens leaves: its full blocks
// and a state after all of them.
func serveOn(t *testing.T, m *hybrid.Manager, tokens []int32) {
	t.Helper()
	p := evPrompt(tokens)
	_, err := m.Prepare(1, len(tokens))
	require.NoError(t, err)
	_, err = m.Publish(1, p)
	require.NoError(t, err)
	ck, err := m.BeginCheckpoint(len(tokens)%evTPB != 0)
	require.NoError(t, err)
	require.NoError(t, m.EndCheckpoint(ck, p, len(tokens)))
	require.NoError(t, m.Free(1))
}

func run(from, n int) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = int32(from + i)
	}
	return s
}

type eventsFixture struct {
	t   *testing.T
	srv *server.Server
	pub *EventPublisher
	sub *EventSubscriber
}

func newEventsFixture(t *testing.T, m *hybrid.Manager, mutate ...func(*server.Options)) *eventsFixture {
	f := &eventsFixture{t: t, srv: natstest.Run(t, mutate...)}
	f.startPublisher(m)
	var err error
	f.sub, err = StartEventSubscriber(natstest.Connect(t, f.srv), EventSubscriberConfig{Namespace: "ev", SyncTimeout: time.Second})
	require.NoError(t, err)
	t.Cleanup(f.sub.Close)
	return f
}

func (f *eventsFixture) startPublisher(m *hybrid.Manager) {
	var err error
	f.pub, err = StartEventPublisher(natstest.Connect(f.t, f.srv), EventPublisherConfig{
		Instance: "p1", Namespace: "ev", Interval: 5 * time.Millisecond,
		Ranks: []EventRank{{Rank: 0, Cache: m, Root: evRoot, BlockSize: evTPB, Medium: kvevents.MediumGPU}},
	})
	require.NoError(f.t, err)
	f.t.Cleanup(f.pub.Close)
}

// waitLongest waits until the subscriber's answer for tokens is want.
func (f *eventsFixture) waitLongest(tokens []int32, want int) {
	f.t.Helper()
	natstest.CheckFor(f.t, 5*time.Second, 5*time.Millisecond, func() error {
		if L, ok := f.sub.Longest("p1", tokens); !ok || L != want {
			return fmt.Errorf("longest %d (ok %v), want %d", L, ok, want)
		}
		return nil
	})
}

func TestEventsTellARouterWhereStateLives(t *testing.T) {
	m := eventsManager(t, 16, 2)
	f := newEventsFixture(t, m)
	conv := run(1, 10)
	next := append(append([]int32(nil), conv...), 50, 51, 52)
	f.waitLongest(next, 0) // the first batch, a snapshot of an empty cache

	serveOn(t, m, conv)
	require.Equal(t, 10, m.Lookup(evPrompt(next)).Tokens)
	f.waitLongest(next, 10)

	// Other prompts evict conv's state (two checkpoint rows).
	serveOn(t, m, run(100, 6))
	serveOn(t, m, run(200, 6))
	require.Equal(t, 0, m.Lookup(evPrompt(next)).Tokens)
	f.waitLongest(next, 0)
	f.waitLongest(append(run(200, 6), 9), 6)
	require.Zero(t, f.sub.Stats().Malformed)
}

// TestEventsResyncAfterALostBatch: a stream whose numbers skip (batches
// lost) is out of sync, answered as unknown, until the subscriber's
// snapshot brings it back, right.
func TestEventsResyncAfterALostBatch(t *testing.T) {
	m := eventsManager(t, 16, 2)
	f := newEventsFixture(t, m)
	conv := run(1, 10)
	next := append(append([]int32(nil), conv...), 50)
	serveOn(t, m, conv)
	f.waitLongest(next, 10)
	syncs := f.sub.Stats().Syncs

	// A batch far ahead: what the subscriber sees after losing some.
	nc := natstest.Connect(t, f.srv)
	b, err := kvevents.Encode(&kvevents.Batch{Instance: "p1", Seq: 1 << 62, Root: evRoot})
	require.NoError(t, err)
	require.NoError(t, nc.Publish(wire.Subject(wire.DefaultPrefix, "ev", wire.SubjectInstanceEvents, "p1"), b))
	require.NoError(t, nc.Flush())
	natstest.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if f.sub.Stats().Gaps == 0 {
			return fmt.Errorf("no gap seen")
		}
		return nil
	})
	// Out of sync: no answer but the cache's until the snapshot the
	// subscriber asks for (at most one a second per stream) brings the
	// stream back; the batches after it apply on top.
	if L, ok := f.sub.Longest("p1", next); ok {
		require.Equal(t, 10, L)
	}
	serveOn(t, m, run(100, 6))
	serveOn(t, m, run(200, 6))
	f.waitLongest(next, 0)
	f.waitLongest(append(run(200, 6), 9), 6)
	require.Greater(t, f.sub.Stats().Syncs, syncs, "the stream came back through a snapshot")
}

// TestEventsFollowARestartedPublisher: a publisher's next life numbers its
// batches after the previous one's, so the subscriber follows it.
func TestEventsFollowARestartedPublisher(t *testing.T) {
	m := eventsManager(t, 16, 2)
	f := newEventsFixture(t, m)
	serveOn(t, m, run(1, 10))
	f.waitLongest(run(1, 11), 10)
	f.pub.Close()
	m2 := eventsManager(t, 16, 2) // the restarted worker's empty cache
	f.startPublisher(m2)
	f.waitLongest(run(1, 11), 0)
	serveOn(t, m2, run(300, 5))
	f.waitLongest(run(300, 7), 5)
}

// TestEventsSnapshotInParts: a cache whose snapshot does not fit in one
// NATS message goes in parts, and the subscriber assembles them.
func TestEventsSnapshotInParts(t *testing.T) {
	m := eventsManager(t, 600, 2)
	for i := range 8 {
		serveOn(t, m, run(1000*i, 4*64+1))
	}
	f := newEventsFixture(t, m, func(o *server.Options) { o.MaxPayload = 4 << 10 })
	last := append(run(7000, 4*64+1), 7)
	require.Equal(t, 4*64+1, m.Lookup(evPrompt(last)).Tokens)
	f.waitLongest(last, 4*64+1)
	require.Zero(t, f.sub.Stats().Malformed)
}

// TestEventsRefuseWhatIsNotAStream: garbage and a batch naming another
// instance than its subject are dropped and counted, and change nothing
// the router answers.
func TestEventsRefuseWhatIsNotAStream(t *testing.T) {
	m := eventsManager(t, 16, 2)
	f := newEventsFixture(t, m)
	serveOn(t, m, run(1, 10))
	f.waitLongest(run(1, 11), 10)
	nc := natstest.Connect(t, f.srv)
	subj := wire.Subject(wire.DefaultPrefix, "ev", wire.SubjectInstanceEvents, "p1")
	require.NoError(t, nc.Publish(subj, []byte("not msgpack")))
	other, err := kvevents.Encode(&kvevents.Batch{Instance: "p2", Seq: 1, Snapshot: true, Root: evRoot,
		Events: []kvevents.Event{{Kind: kvevents.StateStored, Parent: evRoot, Tokens: []int32{1, 2}, NumTokens: 2}}})
	require.NoError(t, err)
	require.NoError(t, nc.Publish(subj, other))
	require.NoError(t, nc.Flush())
	natstest.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n := f.sub.Stats().Malformed; n != 2 {
			return fmt.Errorf("%d malformed", n)
		}
		return nil
	})
	_, ok := f.sub.Longest("p2", []int32{1, 2, 3})
	require.False(t, ok, "a batch under another instance's subject is nobody's")
	f.waitLongest(run(1, 11), 10)
}
