//go:build integration

package integration

// The agent for engines in other languages (issue 33), with real
// processes: a nats-server, two handoff-agent processes and two Python
// engine processes (python/tests/engine.py) holding torch CPU tensors
// shaped like tiny-hybrid's caches. The test plays the engines' scheduler:
// it carries each ticket from the receiving engine to the sending one.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/agent"
	"github.com/handoff-io/handoff/rdma"
)

const debianPython = "/usr/bin/python3"

var (
	agentBinOnce sync.Once
	agentBinErr  error
)

// agentBinary builds cmd/handoff-agent once, into binDir.
func agentBinary(t *testing.T) string {
	t.Helper()
	agentBinOnce.Do(func() {
		out, err := exec.Command("go", "build", "-o", binDir+"/", "../cmd/handoff-agent").CombinedOutput()
		if err != nil {
			agentBinErr = fmt.Errorf("%v: %s", err, out)
		}
	})
	require.NoError(t, agentBinErr, "building handoff-agent")
	return filepath.Join(binDir, "handoff-agent")
}

// needPython skips the test, saying why, without Debian's python3 and the
// packages the client needs.
func needPython(t *testing.T) {
	t.Helper()
	pythonOnce.Do(func() {
		if out, err := exec.Command(debianPython, "-c", "import torch, numpy, msgpack").CombinedOutput(); err != nil {
			pythonMissing = fmt.Sprintf("SKIP: %s cannot import torch, numpy and msgpack (run scripts/install-python): %v: %s", debianPython, err, tail(string(out), 300))
		}
	})
	if pythonMissing != "" {
		t.Skip(pythonMissing)
	}
}

var (
	pythonOnce    sync.Once
	pythonMissing string
)

// agentProc is a running handoff-agent.
type agentProc struct {
	t      *testing.T
	name   string
	sock   string
	args   []string
	cmd    *exec.Cmd
	logf   *os.File
	exited chan struct{}
}

func startAgentProc(t *testing.T, natsURL, name, transports string) *agentProc {
	t.Helper()
	dir, err := os.MkdirTemp("", "handoff-agent-it-") // 0700
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	a := &agentProc{t: t, name: name, sock: filepath.Join(dir, name+".sock"),
		args: []string{"--name", name, "--socket", filepath.Join(dir, name+".sock"), "--transports", transports, "--nats-url", natsURL}}
	a.start()
	t.Cleanup(a.kill)
	return a
}

func (a *agentProc) start() {
	t := a.t
	t.Helper()
	os.Remove(a.sock) // a killed agent leaves its socket behind
	logf, err := os.OpenFile(a.sock+".log", os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	require.NoError(t, err)
	a.logf = logf
	a.cmd = exec.Command(agentBinary(t), a.args...)
	a.cmd.Stdout, a.cmd.Stderr = logf, logf
	require.NoError(t, a.cmd.Start())
	a.exited = make(chan struct{})
	go func(c *exec.Cmd, done chan struct{}) { c.Wait(); close(done) }(a.cmd, a.exited)
	require.Eventually(t, func() bool { _, err := os.Stat(a.sock); return err == nil }, 10*time.Second, 10*time.Millisecond,
		"agent %s did not listen: %s", a.name, a.log())
}

func (a *agentProc) log() string { b, _ := os.ReadFile(a.sock + ".log"); return string(b) }

func (a *agentProc) kill() {
	if a.cmd != nil && a.cmd.Process != nil {
		a.cmd.Process.Kill()
		<-a.exited
		a.logf.Close()
		a.cmd = nil
	}
}

// memfdCount counts the agent's mappings and descriptors of an engine's
// memfds (the Python client names them handoff-kv and handoff-mamba).
func (a *agentProc) memfdCount() (maps, fds int) {
	pid := a.cmd.Process.Pid
	m, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	for _, l := range strings.Split(string(m), "\n") {
		if strings.Contains(l, "memfd:handoff-kv") || strings.Contains(l, "memfd:handoff-mamba") {
			maps++
		}
	}
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, e := range ents {
		l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
		if strings.HasPrefix(l, "/memfd:handoff-kv") || strings.HasPrefix(l, "/memfd:handoff-mamba") {
			fds++
		}
	}
	return maps, fds
}

// pyEngine is a Python engine process driven line by line.
type pyEngine struct {
	t   *testing.T
	cmd *exec.Cmd
	in  *json.Encoder
	out *bufio.Reader
	mu  sync.Mutex
}

func startEngine(t *testing.T) *pyEngine {
	t.Helper()
	cmd := exec.Command(debianPython, "../python/tests/engine.py")
	cmd.Stderr = os.Stderr
	w, err := cmd.StdinPipe()
	require.NoError(t, err)
	r, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	e := &pyEngine{t: t, cmd: cmd, in: json.NewEncoder(w), out: bufio.NewReader(r)}
	t.Cleanup(func() { w.Close(); cmd.Process.Kill(); cmd.Wait() })
	return e
}

// do sends one command and returns the engine's answer; an answer with
// "error" fails the test unless allowErr.
func (e *pyEngine) do(cmd string, args map[string]any) map[string]any {
	e.t.Helper()
	out, err := e.try(cmd, args)
	require.NoError(e.t, err)
	require.Nil(e.t, out["error"], "%s: %v", cmd, out)
	return out
}

func (e *pyEngine) try(cmd string, args map[string]any) (map[string]any, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := map[string]any{"cmd": cmd}
	for k, v := range args {
		m[k] = v
	}
	if err := e.in.Encode(m); err != nil {
		return nil, err
	}
	type res struct {
		line string
		err  error
	}
	ch := make(chan res, 1)
	go func() { l, err := e.out.ReadString('\n'); ch <- res{l, err} }()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, r.err
		}
		var out map[string]any
		return out, json.Unmarshal([]byte(r.line), &out)
	case <-time.After(60 * time.Second):
		return nil, fmt.Errorf("engine did not answer %s", cmd)
	}
}

func (e *pyEngine) digest(blocks []int, row any) string {
	return e.do("digest", map[string]any{"blocks": blocks, "row": row})["sha"].(string)
}

// pair is two engines, each with its own agent, on one NATS.
type pair struct {
	nc            *nats.Conn
	aA, aB        *agentProc
	send, recv    *pyEngine
	sendFP, recv0 map[string]any
}

func startPair(t *testing.T, transports string, cfg map[string]any) *pair {
	t.Helper()
	needPython(t)
	// The engines first: their imports (torch) overlap the rest.
	send, recv := startEngine(t), startEngine(t)
	ns := startNATS(t, nil)
	nc, err := nats.Connect(ns.url())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	p := &pair{nc: nc}
	p.aA = startAgentProc(t, ns.url(), "pre-0", transports)
	p.aB = startAgentProc(t, ns.url(), "dec-0", transports)
	p.send, p.recv = send, recv
	with := func(m map[string]any) map[string]any {
		for k, v := range cfg {
			m[k] = v
		}
		return m
	}
	p.sendFP = p.send.do("start", with(map[string]any{"socket": p.aA.sock, "seed": 1}))
	p.recv0 = p.recv.do("start", with(map[string]any{"socket": p.aB.sock, "seed": 2}))
	return p
}

func TestAgentHandoff(t *testing.T) {
	for _, tr := range []string{"shm", "tcp"} {
		t.Run(tr, func(t *testing.T) {
			p := startPair(t, tr, nil)
			require.Equal(t, p.sendFP["fingerprint"], p.recv0["fingerprint"])

			// The agent answers on NATS with the registration's fingerprint.
			msg, err := p.nc.Request(agent.Subject("default", "dec-0"), nil, 5*time.Second)
			require.NoError(t, err)
			var d agent.Description
			require.NoError(t, msgpack.Unmarshal(msg.Data, &d))
			require.Equal(t, p.recv0["fingerprint"], d.Fingerprint)
			require.Equal(t, p.recv0["agent_id"], d.AgentID)
			// Both agents are in the namespace's registry: each engine
			// lists the other with its registration.
			require.Eventually(t, func() bool {
				ps, _ := p.send.do("peers", nil)["peers"].([]any)
				if len(ps) != 1 {
					return false
				}
				pe, _ := ps[0].(map[string]any)
				return pe["name"] == "dec-0" && pe["fingerprint"] == p.recv0["fingerprint"] && pe["agent_id"] == p.recv0["agent_id"]
			}, 10*time.Second, 20*time.Millisecond, "the sender's peers: %v", p.send.do("peers", nil))

			t.Run("whole", func(t *testing.T) {
				untouched := p.recv.digest([]int{0, 1, 2, 10}, 0)
				g := p.recv.do("grant", map[string]any{"request_id": 41, "blocks": []int{9, 3, 20}, "row": 1, "deadline": 10})
				s := p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": []int{0, 1, 2}, "row": 4})
				require.Equal(t, "send_done", s["kind"], "%v", s)
				ev := p.recv.do("wait", map[string]any{"kind": "grant", "id": g["grant"]})
				require.Equal(t, "grant_done", ev["kind"], "%v", ev)
				require.Equal(t, p.send.digest([]int{0, 1, 2}, 4), p.recv.digest([]int{9, 3, 20}, 1), "blocks and row byte-exact at the named blocks")
				require.Equal(t, untouched, p.recv.digest([]int{0, 1, 2, 10}, 0), "nothing else written")
			})
			t.Run("layer by layer", func(t *testing.T) {
				g := p.recv.do("grant", map[string]any{"request_id": 42, "blocks": []int{30, 31}, "row": 2})
				s := p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": []int{5, 6}, "row": 3, "layers": true})
				require.Equal(t, "send_done", s["kind"], "%v", s)
				require.Equal(t, "grant_done", p.recv.do("wait", map[string]any{"kind": "grant", "id": g["grant"]})["kind"])
				require.Equal(t, p.send.digest([]int{5, 6}, 3), p.recv.digest([]int{30, 31}, 2))
			})
			t.Run("ticket over NATS", func(t *testing.T) {
				g := p.recv.do("grant", map[string]any{"request_id": 45, "blocks": []int{60}, "row": 3})
				p.recv.do("offer", map[string]any{"ticket": g["ticket"], "to": "pre-0"})
				got := p.send.do("wait_ticket", nil)
				require.EqualValues(t, 45, got["request_id"])
				require.Equal(t, "dec-0", got["agent"])
				s := p.send.do("send", map[string]any{"ticket": got["ticket"], "blocks": []int{12}, "row": 2})
				require.Equal(t, "send_done", s["kind"], "%v", s)
				require.Equal(t, p.send.digest([]int{12}, 2), p.recv.digest([]int{60}, 3))
			})
			t.Run("reserved row refused", func(t *testing.T) {
				out, err := p.recv.try("grant", map[string]any{"request_id": 43, "blocks": []int{40}, "row": 7})
				require.NoError(t, err)
				require.Equal(t, "reserved", out["error"], "%v", out)
			})
			t.Run("send after revoke lands nothing", func(t *testing.T) {
				g := p.recv.do("grant", map[string]any{"request_id": 44, "blocks": []int{50, 51}, "row": 5})
				canary := p.recv.digest([]int{50, 51}, 5)
				p.recv.do("revoke", map[string]any{"grant": g["grant"]})
				s := p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": []int{7, 8}, "row": 6})
				require.Equal(t, "send_failed", s["kind"], "%v", s)
				require.Equal(t, "revoked", s["code"], "%v", s)
				require.Equal(t, canary, p.recv.digest([]int{50, 51}, 5), "canary")
			})
		})
	}
}

// TestAgentTP2To1: two TP-2 Python engines, each with its own agent, hand
// one request to a TP-1 engine; the agents reshard, and the receiver's
// blocks and row are the whole model's the two shards were cut from.
func TestAgentTP2To1(t *testing.T) {
	needPython(t)
	senders, recv := []*pyEngine{startEngine(t), startEngine(t)}, startEngine(t)
	ns := startNATS(t, nil)
	for r, e := range senders {
		a := startAgentProc(t, ns.url(), fmt.Sprintf("pre-%d", r), "shm,tcp")
		e.do("start", map[string]any{"socket": a.sock, "seed": 5, "tp_rank": r, "tp_size": 2})
	}
	aR := startAgentProc(t, ns.url(), "dec-0", "shm,tcp")
	recv.do("start", map[string]any{"socket": aR.sock, "seed": 6})
	for i, layers := range []bool{false, true} {
		dst, dstRow := []int{9 + i, 3 + 2*i}, 1+i // other blocks each time: the first send's bytes are no proof of the second's
		require.NotEqual(t, senders[0].do("digest", map[string]any{"blocks": []int{0, 1}, "row": 4, "whole": true})["sha"], recv.digest(dst, dstRow))
		g := recv.do("grant", map[string]any{"request_id": 60 + i, "blocks": dst, "row": dstRow, "from_tp": 2})
		var sends []any
		for _, s := range senders {
			out := s.do("send", map[string]any{"ticket": g["ticket"], "blocks": []int{0, 1}, "row": 4, "layers": layers, "wait": false})
			sends = append(sends, out["send"])
		}
		for j, s := range senders {
			ev := s.do("wait", map[string]any{"kind": "send", "id": sends[j]})
			require.Equal(t, "send_done", ev["kind"], "%v", ev)
		}
		ev := recv.do("wait", map[string]any{"kind": "grant", "id": g["grant"]})
		require.Equal(t, "grant_done", ev["kind"], "%v", ev)
		want := senders[0].do("digest", map[string]any{"blocks": []int{0, 1}, "row": 4, "whole": true})["sha"]
		require.Equal(t, want, senders[1].do("digest", map[string]any{"blocks": []int{0, 1}, "row": 4, "whole": true})["sha"])
		require.Equal(t, want, recv.digest(dst, dstRow), "layers %v: the whole model's bytes", layers)
		require.NotEqual(t, want, senders[0].digest([]int{0, 1}, 4), "a shard is not the whole")
	}
}

// bigLayout makes 64 MiB of KV: 512 blocks of 128 KiB (8 kv heads of
// head_dim 128, bf16, 16 tokens, 2 layers).
var bigLayout = map[string]any{"blocks": 520, "kv": map[string]any{"kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}}

func seq(from, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = from + i
	}
	return s
}

func TestAgentFaults(t *testing.T) {
	t.Run("sending engine killed mid-send", func(t *testing.T) {
		p := startPair(t, "tcp", bigLayout)
		g := p.recv.do("grant", map[string]any{"request_id": 51, "blocks": seq(0, 512), "row": 1, "deadline": 2})
		p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": seq(0, 512), "row": 0, "partial": true})
		p.send.cmd.Process.Kill()
		ev := p.recv.do("wait", map[string]any{"kind": "grant", "id": g["grant"]})
		require.Equal(t, "grant_failed", ev["kind"], "%v", ev)
		after := p.recv.digest(seq(0, 512), 1)
		require.Eventually(t, func() bool { m, f := p.aA.memfdCount(); return m == 0 && f == 0 }, 5*time.Second, 20*time.Millisecond,
			"the sending agent unmapped the dead engine's memory and closed its fds")
		require.Equal(t, after, p.recv.digest(seq(0, 512), 1), "nothing landed after the grant failed")
		g2 := p.recv.do("grant", map[string]any{"request_id": 52, "blocks": seq(0, 512), "row": 1})
		require.NotNil(t, g2["ticket"], "the failed grant's blocks are grantable again")
	})
	t.Run("receiving agent frozen: send_wait ends past the deadline", func(t *testing.T) {
		p := startPair(t, "shm", bigLayout)
		// The link is up (a first send), then the receiver freezes: the
		// send's bytes are copied, and its commit is never answered.
		g := p.recv.do("grant", map[string]any{"request_id": 56, "blocks": []int{0}})
		require.Equal(t, "send_done", p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": []int{0}})["kind"])
		g = p.recv.do("grant", map[string]any{"request_id": 57, "blocks": seq(0, 512), "row": 1, "deadline": 1})
		require.NoError(t, p.aB.cmd.Process.Signal(syscall.SIGSTOP))
		defer p.aB.cmd.Process.Signal(syscall.SIGCONT)
		start := time.Now()
		out, err := p.send.try("send", map[string]any{"ticket": g["ticket"], "blocks": seq(0, 512), "row": 0, "send_wait": true})
		require.NoError(t, err)
		require.Equal(t, "deadline", out["error"], "%v", out)
		require.Less(t, time.Since(start), 10*time.Second, "bounded by the grant's deadline and the agent's grace")
	})
	t.Run("receiving agent killed mid-send, then restarted", func(t *testing.T) {
		p := startPair(t, "tcp", bigLayout)
		maps0, fds0 := p.aA.memfdCount()
		require.Equal(t, 2, fds0, "the sending agent holds one fd per pool")
		g := p.recv.do("grant", map[string]any{"request_id": 53, "blocks": seq(0, 512), "row": 1, "deadline": 5})
		sent := p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": seq(0, 512), "row": 0, "partial": true})
		p.aB.kill()
		// The commit is refused as unknown when the send already failed.
		_, err := p.send.try("commit", map[string]any{"send": sent["send"]})
		require.NoError(t, err)
		ev := p.send.do("wait", map[string]any{"kind": "send", "id": sent["send"]})
		require.Equal(t, "send_failed", ev["kind"], "%v", ev)
		out, err := p.recv.try("grant", map[string]any{"request_id": 54, "blocks": []int{1}})
		require.NoError(t, err)
		require.Equal(t, "closed", out["error"], "the engine gets a clear error: %v", out)
		p.aB.start()
		p.recv.do("connect", map[string]any{"socket": p.aB.sock, "wait": 10})
		g = p.recv.do("grant", map[string]any{"request_id": 55, "blocks": []int{3, 4}, "row": 2})
		s := p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": []int{10, 11}, "row": 3})
		require.Equal(t, "send_done", s["kind"], "%v", s)
		require.Equal(t, p.send.digest([]int{10, 11}, 3), p.recv.digest([]int{3, 4}, 2))
		maps1, fds1 := p.aA.memfdCount()
		require.Equal(t, [2]int{maps0, fds0}, [2]int{maps1, fds1}, "no fd or mapping leaked in the sending agent")
		m, f := p.aB.memfdCount()
		require.Equal(t, [2]int{2, 2}, [2]int{m, f}, "the new agent maps the re-registered pools once")
	})
}

// TestAgentFrozenWriter: the sending agent is stopped (SIGSTOP) while it
// copies a 64 MiB send into the receiver's memory over shm. The revoke
// answers quarantined (the writer may still store into the blocks) or,
// when the stop missed the copy, plainly; either way nothing lands once
// the grant's failure is reported, after the writer resumed.
func TestAgentFrozenWriter(t *testing.T) {
	p := startPair(t, "shm", bigLayout)
	// The link is up first, so that a stop right after the send's answer
	// finds the writer copying, not connecting. A stop that misses the
	// copy (before it, between its brackets, after it) is another round.
	g := p.recv.do("grant", map[string]any{"request_id": 59, "blocks": []int{0}})
	require.Equal(t, "send_done", p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": []int{0}})["kind"])
	quarantined := 0
	for round := 0; round < 12 && quarantined == 0; round++ {
		g := p.recv.do("grant", map[string]any{"request_id": 60 + round, "blocks": seq(0, 512), "row": 1, "deadline": 30})
		sent := p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": seq(0, 512), "row": 0, "wait": false})
		require.NoError(t, p.aA.cmd.Process.Signal(syscall.SIGSTOP))
		out, err := p.recv.try("revoke", map[string]any{"grant": g["grant"]})
		require.NoError(t, err)
		switch out["error"] {
		case "quarantined":
			quarantined++
		case nil:
		default:
			t.Fatalf("round %d: revoke: %v", round, out)
		}
		stopped := p.recv.digest(seq(0, 512), 1)
		require.NoError(t, p.aA.cmd.Process.Signal(syscall.SIGCONT))
		ev := p.recv.do("wait", map[string]any{"kind": "grant", "id": g["grant"]})
		t.Logf("round %d: revoke %v, then %v", round, out["error"], ev["kind"])
		if ev["kind"] == "grant_done" {
			continue // the send had ended before the stop
		}
		require.Equal(t, "grant_failed", ev["kind"], "%v", ev)
		after := p.recv.digest(seq(0, 512), 1)
		if out["error"] == nil {
			require.Equal(t, stopped, after, "round %d: nothing landed after the revoke", round)
		}
		time.Sleep(100 * time.Millisecond)
		require.Equal(t, after, p.recv.digest(seq(0, 512), 1), "round %d: nothing landed after grant_failed", round)
		p.send.do("wait", map[string]any{"kind": "send", "id": sent["send"]})
	}
	require.NotZero(t, quarantined, "no round stopped the writer inside its copy")
}

// TestAgentMeasure prints the figures docs/agent.md quotes: a 64 MiB send
// through two agents against the same send between two Go engines (the
// workers' data path), same transport, same run; and a small send (one
// block, one row) against a raw NATS round trip.
func TestAgentMeasure(t *testing.T) {
	if os.Getenv("HANDOFF_AGENT_MEASURE") == "" {
		t.Skip("SKIP: set HANDOFF_AGENT_MEASURE=1 to measure (about 30 s)")
	}
	for _, tr := range []string{"shm", "tcp"} {
		t.Run(tr, func(t *testing.T) {
			p := startPair(t, tr, bigLayout)
			const reps = 16
			// The receiver's blocks in reverse order, so that no two of its
			// extents merge, as in goWriter; the sender's are one run. The
			// agents' sends and the engines' writes alternate, so that all
			// meet the same moments of a shared machine. Two Go workers are
			// two processes (goWriterProcess); the engines in this process
			// (goWriter) are given for reference.
			blocks, rev := seq(0, 512), seq(0, 512)
			slices.Reverse(rev)
			const size = 512 * 128 << 10
			goWrite := goWriter(t, rdma.Transport(tr), size, 512)
			goWriteProc := goWriterProcess(t, rdma.Transport(tr), size, 512, 1)
			agentBest, goBest, procBest := 1e9, 1e9, 1e9
			// Each round's ratio as well as the bests': on a shared machine
			// the best of either side is one lucky moment, while the rounds'
			// median compares sends that met the same moments.
			var rounds []float64
			for i := range reps {
				g := p.recv.do("grant", map[string]any{"request_id": 100 + i, "blocks": rev, "row": 1})
				s := p.send.do("send", map[string]any{"ticket": g["ticket"], "blocks": blocks, "row": 0})
				require.Equal(t, "send_done", s["kind"], "%v", s)
				p.recv.do("wait", map[string]any{"kind": "grant", "id": g["grant"]})
				took, proc := s["seconds"].(float64), goWriteProc(1, 0)[0]
				agentBest, procBest = min(agentBest, took), min(procBest, proc)
				rounds = append(rounds, proc/took)
				goBest = min(goBest, goWrite())
			}
			sort.Float64s(rounds)
			t.Logf("MEASURE %s 64MiB: agent %.2f GB/s (%.1f ms), two Go workers (processes) %.2f GB/s (%.1f ms), ratio %.2f; median of %d rounds' ratios %.2f",
				tr, size/agentBest/1e9, agentBest*1e3, size/procBest/1e9, procBest*1e3, procBest/agentBest, reps, rounds[reps/2])
			t.Logf("MEASURE %s 64MiB: two Go engines in this process %.2f GB/s (%.1f ms), ratio %.2f",
				tr, size/goBest/1e9, goBest*1e3, goBest/agentBest)

			// Small sends (one block and one row) as send + its event and
			// as send_wait (one message back), back to back and 2 ms apart,
			// each against NATS round trips between processes taken with
			// the same gaps: on a small machine a process that slept wakes
			// far slower than a busy one, for the agents and NATS alike, so
			// only figures of one spacing compare. A batch's sends follow
			// seven grants (one per free row) opened through the engines'
			// pipes; its first send, which follows them, is a warm-up, as
			// the NATS requester's first 50 round trips are.
			//
			// What the agents add to a small send is the send less the same
			// write between two Go workers (processes, batches of seven
			// grants and writes at the same spacing), which pay the data
			// path's own cost without an engine's hops to its agent.
			gaps := []time.Duration{0, 2 * time.Millisecond}
			xrtts := natsRoundTrips(t, 300, gaps...)
			goSmall := goWriterProcess(t, rdma.Transport(tr), 128<<10+smallRow, 2, 7)
			var warmSend float64
			for gi, gap := range gaps {
				var sends, waits, gos []float64
				for round := range 12 {
					var tickets, grants []any
					for r := range 7 {
						g := p.recv.do("grant", map[string]any{"request_id": 1000*(gi+1) + 10*round + r, "blocks": []int{512 + r}, "row": r})
						tickets, grants = append(tickets, g["ticket"]), append(grants, g["grant"])
					}
					small := p.send.do("small", map[string]any{"tickets": tickets, "src_block": 0, "src_row": 0, "wait": round%2 == 1, "gap": gap.Seconds()})
					for _, id := range grants {
						require.Equal(t, "grant_done", p.recv.do("wait", map[string]any{"kind": "grant", "id": id})["kind"])
					}
					times, _ := small["times"].([]any)
					require.Len(t, times, len(tickets), "%v", small)
					gos = append(gos, goSmall(7, gap)[1:]...)
					for _, x := range times[1:] {
						if round%2 == 1 {
							waits = append(waits, x.(float64)*1e6)
						} else {
							sends = append(sends, x.(float64)*1e6)
						}
					}
				}
				sort.Float64s(sends)
				sort.Float64s(waits)
				sort.Float64s(gos)
				send, wait, gow := sends[len(sends)/2], waits[len(waits)/2], gos[len(gos)/2]*1e6
				xrtt := float64(xrtts[gi][len(xrtts[gi])/2].Nanoseconds()) / 1e3
				spacing := "back to back"
				if gap > 0 {
					spacing = gap.String() + " apart"
				} else {
					warmSend = send
				}
				t.Logf("MEASURE %s small send (1 block of 128 KiB + 1 row), %s: p50 %.0f µs (min %.0f), send_wait p50 %.0f µs (min %.0f); NATS round trip between processes (requester, server, responder), %s: p50 %.0f µs (min %.0f); send ratio %.2f, send_wait ratio %.2f",
					tr, spacing, send, sends[0], wait, waits[0], spacing, xrtt, float64(xrtts[gi][0].Nanoseconds())/1e3, send/xrtt, wait/xrtt)
				t.Logf("MEASURE %s small send, %s: the same write between two Go workers (processes) p50 %.0f µs (min %.0f); added by the agents: send %.0f µs, send_wait %.0f µs; added ratio %.2f, send_wait %.2f (against NATS p50 %.0f µs)",
					tr, spacing, gow, gos[0]*1e6, send-gow, wait-gow, (send-gow)/xrtt, (wait-gow)/xrtt, xrtt)
			}
			sub, err := p.nc.Subscribe("measure.echo", func(m *nats.Msg) { m.Respond(m.Data) })
			require.NoError(t, err)
			defer sub.Unsubscribe()
			require.NoError(t, p.nc.Flush()) // the server knows the subscription before nc2 asks
			nc2, err := nats.Connect(p.nc.ConnectedUrl())
			require.NoError(t, err)
			defer nc2.Close()
			var rtts []time.Duration
			for range 50 {
				start := time.Now()
				_, err := nc2.Request("measure.echo", make([]byte, 64), 5*time.Second)
				require.NoError(t, err)
				rtts = append(rtts, time.Since(start))
			}
			slices.Sort(rtts)
			rtt := float64(rtts[len(rtts)/2].Nanoseconds()) / 1e3
			t.Logf("MEASURE %s NATS round trip within this process (server and both clients), back to back: p50 %.0f µs; send ratio %.2f",
				tr, rtt, warmSend/rtt)
			// The same small send between two Go engines (the workers' data
			// path, no agent): what the data path alone costs.
			_, inProc := goSend(t, rdma.Transport(tr), 128<<10+int64(smallRow), 2, 30)
			t.Logf("MEASURE %s small send between two Go engines in this process: p50 %.0f µs", tr, inProc*1e6)
		})
	}
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// smallRow is a tiny-hybrid Mamba row's bytes (3 layers of conv and SSM state, fp32).
var goSeq atomic.Int64

const smallRow = 3 * ((4*16+2*2*16)*3*4 + 4*16*16*4)

// goSend is the best and the median time of reps writes of size bytes in
// n extents between two rdma engines in this process over tr, as two
// workers do.
func goSend(t *testing.T, tr rdma.Transport, size int64, n, reps int) (best, median float64) {
	t.Helper()
	write := goWriter(t, tr, size, n)
	var times []float64
	for range reps {
		times = append(times, write())
	}
	sort.Float64s(times)
	return times[0], times[len(times)/2]
}

// reversedExtents cuts size bytes of region into n extents: n-1 in
// reverse order, which do not continue each other (as the agent's 512
// reversed blocks), then the last.
func reversedExtents(region rdma.RegionID, size int64, n int) []rdma.Extent {
	per := uint64(size) / uint64(n)
	ext := make([]rdma.Extent, 0, n)
	for i := range n {
		l := per
		if i == n-1 {
			l = uint64(size) - uint64(i)*per
		}
		ext = append(ext, rdma.Extent{Region: region, Offset: uint64(i) * per, Length: l})
	}
	slices.Reverse(ext[:n-1])
	return ext
}

// goWriter sets up two rdma engines in this process over tr, the
// destination's size bytes in n extents, and returns a function that makes
// one write of them as two workers do and times its Write (the write and
// the commit's verdict; the grant is opened before, waited for after).
func goWriter(t *testing.T, tr rdma.Transport, size int64, n int) func() float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	mk := func(name string) (*rdma.Engine, *rdma.Region) {
		e, err := rdma.New(rdma.Config{Agent: rdma.AgentID(name), Transports: []rdma.Transport{tr}, Logger: quietLogger()})
		require.NoError(t, err)
		t.Cleanup(func() { e.Close() })
		r, err := e.Register("kv", size)
		require.NoError(t, err)
		return e, r
	}
	seq := goSeq.Add(1)
	src, sr := mk(fmt.Sprintf("go-pre-%d", seq))
	dst, dr := mk(fmt.Sprintf("go-dec-%d", seq))
	for i := range sr.Bytes() {
		sr.Bytes()[i] = byte(i * 7)
	}
	ext := reversedExtents(dr.ID(), size, n)
	_, err := src.Connect(ctx, dst.Descriptor())
	require.NoError(t, err)
	var req uint64
	return func() float64 {
		req++
		g, err := dst.OpenGrant(rdma.GrantSpec{RequestID: req, Extents: ext})
		require.NoError(t, err)
		start := time.Now()
		_, err = src.Write(ctx, dst.Descriptor(), g.Ticket(), []rdma.Extent{{Region: sr.ID(), Length: uint64(size)}})
		require.NoError(t, err)
		took := time.Since(start).Seconds()
		_, err = g.Wait(ctx)
		require.NoError(t, err)
		return took
	}
}
