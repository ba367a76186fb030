//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/kvevents"
)

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatReply struct {
	Status     int
	Content    string
	Prompt     int // usage.prompt_tokens
	Cached     int // usage.prompt_tokens_details.cached_tokens
	Completion int // usage.completion_tokens
	Err        string
}

// chat sends one chat completion and returns the reply and its usage's
// cached_tokens.
func chat(ctx context.Context, api, model string, msgs []chatMessage, maxTokens int, temp float64, seed uint64) (chatReply, error) {
	body, _ := json.Marshal(map[string]any{
		"model": model, "messages": msgs, "max_completion_tokens": maxTokens, "temperature": temp, "seed": seed,
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return chatReply{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return chatReply{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return chatReply{}, err
	}
	var out struct {
		Choices []struct {
			Message chatMessage `json:"message"`
		} `json:"choices"`
		Usage struct {
			Prompt     int `json:"prompt_tokens"`
			Completion int `json:"completion_tokens"`
			Details    struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		return chatReply{Status: resp.StatusCode}, fmt.Errorf("status %d, body %q: %w", resp.StatusCode, raw, err)
	}
	r := chatReply{Status: resp.StatusCode, Prompt: out.Usage.Prompt, Cached: out.Usage.Details.Cached, Completion: out.Usage.Completion}
	if len(out.Choices) > 0 {
		r.Content = out.Choices[0].Message.Content
	}
	if out.Error != nil {
		r.Err = out.Error.Message
	}
	return r, nil
}

// TestPrefixCacheOracle is the prefix cache's oracle over the real
// binaries: multi-turn conversations (each turn appends the reply and a
// new user message), conversations that share a system prompt, a branch
// (two continuations of one turn) and a resent conversation get, from
// workers with the prefix cache, exactly the replies of an aggregated
// worker without it: aggregated, disaggregated with and without
// layer-wise streaming, --prefill auto (a conversation's next turn
// continues on the decode that holds its state), a TP-2 prefill group,
// pools so small that they evict, two prefill instances routed by their
// cache events, and speculative decoding with the model's draft head. The later turns are served mostly from the cache.
func TestPrefixCacheOracle(t *testing.T) {
	ns := startNATS(t, nil)
	oracle := startProc(t, "decode", "--prefill", "local", "--prefix-cache", "off", "--nats-url", ns.url(), "--namespace", "px-oracle")
	type target struct {
		name  string
		api   *proc
		procs []*proc
		roomy bool // every later turn must hit
	}
	var targets []*target
	add := func(name string, roomy bool, pre []string, dec []string, prefills ...int) {
		space := "px-" + name
		common := []string{"--nats-url", ns.url(), "--namespace", space, "--prefix-cache", "on"}
		tg := &target{name: name, roomy: roomy}
		n := 1
		if len(prefills) > 0 {
			n = prefills[0]
		}
		for range n {
			if pre != nil {
				tg.procs = append(tg.procs, startProc(t, "prefill", append(common, pre...)...))
			}
		}
		tg.api = startProc(t, "decode", append(common, dec...)...)
		tg.procs = append(tg.procs, tg.api)
		targets = append(targets, tg)
	}
	add("aggregated", true, nil, []string{"--prefill", "local", "--state-checkpoint-interval", "64"})
	add("disaggregated", true, []string{"--layerwise", "off"}, []string{"--prefill", "remote"})
	add("layerwise-chunked", true, []string{"--layerwise", "on", "--prefill-chunk-tokens", "48", "--state-checkpoint-interval", "64"}, []string{"--prefill", "remote"})
	add("auto", true, []string{"--layerwise", "on"}, []string{"--prefill", "auto", "--prefill-auto-min-tokens", "96"})
	add("tp2-layerwise", true, []string{"--layerwise", "on", "--tp-size", "2"}, []string{"--prefill", "remote"})
	// Two prefill instances: every later turn must go where the cache
	// events say its state is (load alone would alternate and miss).
	add("two-prefill-state", true, []string{"--layerwise", "off"}, []string{"--prefill", "remote", "--prefill-routing", "state"}, 2)
	// Speculation with the draft head: its KV is a layer of the shared and
	// delta-handed blocks, and the replies are plain tiny-hybrid's.
	mtp := []string{"--model", "tiny-hybrid?mtp=1"}
	add("mtp", true, append(mtp, "--layerwise", "on"),
		append(mtp, "--prefill", "remote", "--speculative", "mtp", "--num-speculative-tokens", "3"))
	add("tiny-pools", false, []string{"--max-batch-size", "2", "--kv-blocks", "160", "--state-checkpoints", "2", "--layerwise", "on"},
		[]string{"--prefill", "remote", "--max-batch-size", "2"})
	oracle.waitReady(readyWithin)
	for _, tg := range targets {
		for _, p := range tg.procs {
			p.waitReady(readyWithin)
		}
	}
	name := modelName(t, oracle.api)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	for _, tg := range targets {
		warmUp(ctx, t, tg.api.api, name)
	}

	system := chatMessage{Role: "system", Content: "You are a terse assistant. " + strings.Repeat("Answer in few words. ", 6)}
	users := [][]string{
		{"What is a hybrid model?", "And a Mamba layer?", "Why keep a state row?", "How big is it?", "Thanks, bye."},
		{"Tell me about KV caches.", "Paged how?", "What is a block?", "ok"},
		{"Hello!", "Say more.", "More.", "Even more, at length please: " + strings.Repeat("why ", 10), "done"},
	}
	type conv struct {
		msgs []chatMessage // as the oracle answered
		temp float64
	}
	convs := make([]*conv, len(users))
	for i := range convs {
		convs[i] = &conv{msgs: []chatMessage{system}}
		if i == 2 {
			convs[i].temp = 0.8 // sampled, seeded: the same draw with or without the cache
		}
	}
	cached := map[string]int{}
	ask := func(what string, msgs []chatMessage, temp float64, seed uint64, later bool) string {
		want, err := chat(ctx, oracle.api, name, msgs, 12, temp, seed)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, want.Status, "oracle %s: %s", what, want.Err)
		require.Zero(t, want.Cached, "the oracle has no cache")
		var wg sync.WaitGroup
		got := make([]chatReply, len(targets))
		errs := make([]error, len(targets))
		for i, tg := range targets {
			wg.Go(func() { got[i], errs[i] = chat(ctx, tg.api.api, name, msgs, 12, temp, seed) })
		}
		wg.Wait()
		for i, tg := range targets {
			require.NoError(t, errs[i], "%s %s", tg.name, what)
			require.Equal(t, http.StatusOK, got[i].Status, "%s %s: %s", tg.name, what, got[i].Err)
			require.Equal(t, want.Content, got[i].Content, "%s %s: the reply differs from the cache-off one", tg.name, what)
			cached[tg.name] += got[i].Cached
			if later && tg.roomy {
				require.Positive(t, got[i].Cached, "%s %s: a later turn computed its whole prompt", tg.name, what)
			}
		}
		return want.Content
	}
	for turn := range 5 {
		for i, c := range convs {
			if turn >= len(users[i]) {
				continue
			}
			c.msgs = append(c.msgs, chatMessage{Role: "user", Content: users[i][turn]})
			reply := ask(fmt.Sprintf("conversation %d turn %d", i, turn+1), c.msgs, c.temp, uint64(10+i), turn > 0)
			c.msgs = append(c.msgs, chatMessage{Role: "assistant", Content: reply})
		}
		if turn == 2 {
			// A branch: another continuation of conversation 0's second turn.
			branch := append(append([]chatMessage(nil), convs[0].msgs[:5]...), chatMessage{Role: "user", Content: "Something else."})
			ask("branch of conversation 0", branch, 0, 1, true)
		}
	}
	// A resent conversation: the same prompt as an earlier turn.
	ask("resent conversation 1", convs[1].msgs[:len(convs[1].msgs)-1], 0, 11, true)

	for _, tg := range targets {
		t.Logf("%s: %d prompt tokens served from the prefix cache", tg.name, cached[tg.name])
		require.Positive(t, cached[tg.name], tg.name)
		for _, p := range tg.procs {
			requireIdle(t, p, p.name)
		}
	}
	for _, tg := range targets {
		if tg.name == "tiny-pools" {
			ev := sum(tg.procs[0].metrics(), "handoff_prefix_evictions_total", map[string]string{"role": "prefill"})
			t.Logf("tiny-pools: %.0f evictions", ev)
			require.Positive(t, ev, "the tiny pools evicted nothing: the case tests no eviction")
		}
	}
	hits := 0.0
	for _, tg := range targets[1:] {
		hits += sum(tg.procs[0].metrics(), "handoff_prefix_hit_tokens_total", map[string]string{"role": "prefill"})
	}
	require.Positive(t, hits, "the prefill workers' metrics count their hits")
	for _, tg := range targets {
		if tg.name == "mtp" {
			m := tg.api.metrics()
			d := sum(m, "handoff_spec_draft_tokens_total", map[string]string{"method": "mtp"})
			a := sum(m, "handoff_spec_accepted_tokens_total", map[string]string{"method": "mtp"})
			sh := sum(m, "handoff_spec_shipped_draft_tokens_total", map[string]string{"method": "mtp"})
			t.Logf("mtp: %.0f drafts, %.0f accepted, %.0f shipped by prefill", d, a, sh)
			require.Positive(t, a, "the draft head's drafts were never accepted")
			require.Positive(t, sh, "prefill shipped no drafts")
		}
		if tg.name == "two-prefill-state" {
			n := sum(tg.api.metrics(), "handoff_prefill_routed_total", map[string]string{"by": "state"})
			t.Logf("two-prefill-state: %.0f handoffs routed by cached state", n)
			require.Positive(t, n, "no handoff went where the cache events said its state was")
		}
	}
}

// TestPrefixAffinityAcrossPrefillInstances: with two prefill instances, a
// decode sends each turn of a conversation to the instance whose prefix
// cache holds the last one (as the instances' cache events say), so every later turn is served from the cache
// at least up to the previous turn's whole prompt (load-only routing
// alternates between the two and recomputes every other turn). When that
// instance is killed mid-conversation, the next turn is prefilled by the
// survivor from what it holds, and the turns after it stick to the
// survivor; every reply equals the aggregated cache-off one.
//
// The instances publish their events every 50 ms, and a turn sent the
// moment the last reply arrives may reach the decode before the event of
// the last prompt's state (it then goes where affinity remembers, to the
// same instance, and is counted so). Like a client that reads a reply
// before it answers, the test sends each turn once the prefill instances
// have published the state the last turn left: then every routing is the
// events'.
func TestPrefixAffinityAcrossPrefillInstances(t *testing.T) {
	ns := startNATS(t, nil)
	oracle := startProc(t, "decode", "--prefill", "local", "--prefix-cache", "off", "--nats-url", ns.url(), "--namespace", "aff-oracle")
	common := []string{"--nats-url", ns.url(), "--namespace", "aff", "--request-timeout", "60s"}
	pres := []*proc{
		startProc(t, "prefill", append(common, "--instance-id", "aff-prefill-0")...),
		startProc(t, "prefill", append(common, "--instance-id", "aff-prefill-1")...),
	}
	dec := startProc(t, "decode", append(common, "--prefill", "remote")...)
	// The longest state a prefill instance has published, over both.
	nc, err := nats.Connect(ns.url())
	require.NoError(t, err)
	defer nc.Close()
	var published atomic.Int64
	sub, err := nc.Subscribe("handoff.aff.inst.*.kvevents", func(m *nats.Msg) {
		b, err := kvevents.Decode(m.Data)
		if err != nil || !strings.HasPrefix(b.Instance, "aff-prefill-") {
			return
		}
		for _, e := range b.Events {
			if e.Kind == kvevents.StateStored && int64(e.NumTokens) > published.Load() {
				published.Store(int64(e.NumTokens))
			}
		}
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	for _, p := range append(pres, oracle, dec) {
		p.waitReady(readyWithin)
	}
	name := modelName(t, dec.api)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	warmUp(ctx, t, dec.api, name)
	served := func(p *proc) float64 {
		return sum(p.metrics(), "handoff_requests_total", map[string]string{"role": "prefill", "result": "ok"})
	}
	msgs := []chatMessage{{Role: "system", Content: "You keep answers short. " + strings.Repeat("Be brief. ", 8)}}
	prev := 0
	killed := -1
	for turn := range 8 {
		msgs = append(msgs, chatMessage{Role: "user", Content: fmt.Sprintf("Question number %d, please answer.", turn+1)})
		if turn == 4 {
			// Kill the instance that served the conversation so far.
			killed = 0
			if served(pres[1]) > served(pres[0]) {
				killed = 1
			}
			pres[killed].kill()
		}
		want, err := chat(ctx, oracle.api, name, msgs, 10, 0, 1)
		require.NoError(t, err)
		got, err := chat(ctx, dec.api, name, msgs, 10, 0, 1)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, got.Status, "turn %d: %s", turn+1, got.Err)
		require.Equal(t, want.Content, got.Content, "turn %d: the reply differs from the cache-off one", turn+1)
		t.Logf("turn %d: %d of %d prompt tokens cached", turn+1, got.Cached, got.Prompt)
		if turn > 0 && turn != 4 {
			require.GreaterOrEqual(t, got.Cached, prev, "turn %d: not served where the last turn's state is", turn+1)
		}
		prev = got.Prompt
		msgs = append(msgs, chatMessage{Role: "assistant", Content: got.Content})
		require.Eventually(t, func() bool { return published.Load() >= int64(got.Prompt) }, 10*time.Second, 5*time.Millisecond,
			"turn %d: no prefill instance published the state of its %d-token prompt", turn+1, got.Prompt)
	}
	requireIdle(t, dec, "decode")
	requireIdle(t, pres[1-killed], "prefill")
	// Turns 2-4 and 6-8 went where the cache events said their state was.
	byState := sum(dec.metrics(), "handoff_prefill_routed_total", map[string]string{"by": "state"})
	require.GreaterOrEqual(t, byState, 6.0, "turns routed by the prefill instances' cache events")
	require.Positive(t, sum(dec.metrics(), "handoff_cache_event_batches_total", map[string]string{"result": "applied"}))
}

// TestConversationsTwoByTwo is issue 31's deployment over the real
// binaries: two TP-2 prefill groups and two TP-1 decode workers on one
// NATS server, state routing and delta handoffs on. Three conversations
// alternate their turns between the decode workers (a load balancer
// without stickiness), so a turn's prefill often runs on another
// instance than the last one's (its state resharded 2 → 1 on the way),
// and its decode holds the conversation's blocks on some turns and not on
// others. Midway the prefill instance that served the most is killed,
// and a turn later one decode worker: every reply equals the aggregated
// cache-off one, the later turns are served from the caches, some
// handoffs moved only what their decode lacked, and the survivors end
// idle.
func TestConversationsTwoByTwo(t *testing.T) {
	ns := startNATS(t, nil)
	oracle := startProc(t, "decode", "--prefill", "local", "--prefix-cache", "off", "--nats-url", ns.url(), "--namespace", "2x2-oracle")
	common := []string{"--nats-url", ns.url(), "--namespace", "2x2", "--request-timeout", "60s", "--prefix-cache", "on"}
	pres := []*proc{startProc(t, "prefill", append(common, "--tp-size", "2")...), startProc(t, "prefill", append(common, "--tp-size", "2")...)}
	decs := []*proc{startProc(t, "decode", append(common, "--prefill", "remote")...), startProc(t, "decode", append(common, "--prefill", "remote")...)}
	for _, p := range append(append([]*proc{oracle}, pres...), decs...) {
		p.waitReady(readyWithin)
	}
	name := modelName(t, oracle.api)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	for _, d := range decs {
		warmUp(ctx, t, d.api, name)
	}
	served := func(p *proc) float64 {
		return sum(p.metrics(), "handoff_requests_total", map[string]string{"role": "prefill", "result": "ok"})
	}
	system := chatMessage{Role: "system", Content: "You are a terse assistant. " + strings.Repeat("Answer in few words. ", 8)}
	convs := make([][]chatMessage, 3)
	for i := range convs {
		convs[i] = []chatMessage{system}
	}
	alive, killed := decs, -1
	cached := 0
	for turn := range 6 {
		switch turn {
		case 3:
			killed = 0
			if served(pres[1]) > served(pres[0]) {
				killed = 1
			}
			pres[killed].kill()
		case 4:
			decs[1].kill()
			alive = decs[:1]
		}
		for i := range convs {
			convs[i] = append(convs[i], chatMessage{Role: "user", Content: fmt.Sprintf("Conversation %d, question %d: go on.", i, turn+1)})
			temp := 0.0
			if i == 2 {
				temp = 0.8 // sampled, seeded
			}
			want, err := chat(ctx, oracle.api, name, convs[i], 10, temp, uint64(20+i))
			require.NoError(t, err)
			dec := alive[(turn+i)%len(alive)]
			got, err := chat(ctx, dec.api, name, convs[i], 10, temp, uint64(20+i))
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, got.Status, "conversation %d turn %d: %s", i, turn+1, got.Err)
			require.Equal(t, want.Content, got.Content, "conversation %d turn %d: the reply differs from the cache-off one", i, turn+1)
			if turn > 0 {
				cached += got.Cached
			}
			convs[i] = append(convs[i], chatMessage{Role: "assistant", Content: want.Content})
		}
	}
	t.Logf("later turns: %d prompt tokens served from the caches", cached)
	require.Positive(t, cached)
	skipped := sum(decs[0].metrics(), "handoff_delta_skipped_blocks_total", nil)
	t.Logf("decode 0: %.0f blocks it held were not sent again", skipped)
	require.Positive(t, skipped, "no handoff moved only what its decode lacked")
	requireIdle(t, decs[0], "decode")
	requireIdle(t, pres[1-killed], "prefill")
}
