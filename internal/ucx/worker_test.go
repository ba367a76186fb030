//go:build linux && cgo && ucx

package ucx_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/handoff-io/handoff/internal/leakcheck"
	"github.com/handoff-io/handoff/internal/ucx"
)

func TestMain(m *testing.M) {
	// cma serves rendezvous on peer-error-mode endpoints only when it
	// claims to invalidate memory (UCX_CMA_MEMORY_INVALIDATE); a transport
	// setting, so it goes in the environment (children inherit it).
	if _, ok := os.LookupEnv("UCX_CMA_MEMORY_INVALIDATE"); !ok {
		os.Setenv("UCX_CMA_MEMORY_INVALIDATE", "y") //nolint:errcheck
	}
	if role := os.Getenv("UCX_TEST_HELPER"); role != "" {
		os.Exit(helper(role))
	}
	leakcheck.Main(m)
}

// transports are the UCX_TLS sets the tests run over. cma moves rendezvous
// payloads by the receiver's process_vm_readv; tcp by fragments the
// receiver copies.
var transports = []struct {
	name string
	opts map[string]string
}{
	{"tcp", map[string]string{"TLS": "tcp"}},
	{"cma,tcp", map[string]string{"TLS": "cma,tcp"}},
}

// skipCMA skips a test over cma where this host forbids it.
func skipCMA(t *testing.T, tls string) {
	if !strings.Contains(tls, "cma") {
		return
	}
	b, err := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
	if err != nil {
		return // no Yama: same-uid process_vm_readv is allowed
	}
	// At 1 UCX itself allows any same-uid tracer (prctl PR_SET_PTRACER_ANY).
	if s := strings.TrimSpace(string(b)); s != "0" && s != "1" {
		t.Skipf("cma needs kernel.yama.ptrace_scope 0 or 1, this host has %s", s)
	}
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// region is memory from mmap, as the data path's registered regions are.
func region(t testing.TB, n int) []byte {
	t.Helper()
	if n == 0 {
		return nil
	}
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) }) //nolint:errcheck
	return b
}

// fill writes a pattern that differs per seed and per 8-byte word.
func fill(b []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 + 1
	var w [8]byte
	for i := 0; i < len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(w[:], x)
		copy(b[i:], w[:])
	}
}

func newWorker(t testing.TB, cfg ucx.Config) *ucx.Worker {
	t.Helper()
	w, err := ucx.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := w.Close(); err != nil {
			t.Error(err)
		}
	})
	return w
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// landing is a receiver's record of one message.
type landing struct {
	hdr  string
	n    int
	rndv bool
	crc  uint32
	err  error
}

// sink is a receiver that admits every message whose header does not start
// with "no" into a fresh destination under token 1, and reports landings.
type sink struct {
	t     testing.TB
	mu    sync.Mutex
	dests map[string][]byte
	out   chan landing
}

func newSink(t testing.TB) *sink {
	return &sink{t: t, dests: map[string][]byte{}, out: make(chan landing, 64)}
}

func (s *sink) admit(m ucx.Message) (ucx.Admission, error) {
	h := string(m.Header)
	if strings.HasPrefix(h, "no") {
		return ucx.Admission{}, errors.New("refused")
	}
	dst := region(s.t, m.Length)
	s.mu.Lock()
	s.dests[h] = dst
	s.mu.Unlock()
	rndv := m.Rendezvous
	return ucx.Admission{Dest: dst, Token: 1, Done: func(err error) {
		s.out <- landing{hdr: h, n: len(dst), rndv: rndv, crc: crc32.Checksum(dst, castagnoli), err: err}
	}}, nil
}

func (s *sink) next(t testing.TB, d time.Duration) landing {
	t.Helper()
	select {
	case l := <-s.out:
		return l
	case <-time.After(d):
		t.Fatalf("no landing within %v", d)
		return landing{}
	}
}

func pair(t testing.TB, opts map[string]string, admit ucx.AdmitFunc) (snd, rcv *ucx.Worker, ep ucx.EndpointID) {
	t.Helper()
	rcv = newWorker(t, ucx.Config{Name: "rcv", Admit: admit, Options: opts})
	snd = newWorker(t, ucx.Config{Name: "snd", Options: opts})
	ep, err := snd.Connect(ctxT(t, 10*time.Second), rcv.Address())
	if err != nil {
		t.Fatal(err)
	}
	return snd, rcv, ep
}

func TestInProcessBytesLand(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			skipCMA(t, tr.name)
			s := newSink(t)
			snd, rcv, ep := pair(t, tr.opts, s.admit)
			for i, n := range []int{8<<20 + 3, 1, 64 << 10, 0, 32 << 20} {
				src := region(t, n)
				fill(src, uint64(i))
				hdr := fmt.Sprintf("msg %d", i)
				if err := snd.Send(ctxT(t, 30*time.Second), ep, []byte(hdr), src); err != nil {
					t.Fatalf("send %d bytes: %v", n, err)
				}
				l := s.next(t, 30*time.Second)
				if l.err != nil || l.hdr != hdr || l.n != n || l.crc != crc32.Checksum(src, castagnoli) {
					t.Fatalf("landed %+v; want %q, %d bytes, crc %08x", l, hdr, n, crc32.Checksum(src, castagnoli))
				}
				if l.rndv != (n > 0) {
					t.Errorf("%d bytes: rendezvous %v", n, l.rndv)
				}
			}
			info, err := snd.EndpointInfo(ctxT(t, 5*time.Second), ep)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("sender endpoint:\n%s", info)
			if st := rcv.Stats(); st.Admitted != 5 || st.Received != 5 || st.ReceiveFailed != 0 {
				t.Errorf("receiver stats %+v", st)
			}
		})
	}
}

func TestRejectReachesSender(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			skipCMA(t, tr.name)
			s := newSink(t)
			snd, rcv, ep := pair(t, tr.opts, s.admit)
			src := region(t, 4<<20)
			fill(src, 1)
			err := snd.Send(ctxT(t, 10*time.Second), ep, []byte("no thanks"), src)
			if !errors.Is(err, ucx.ErrRejected) {
				t.Fatalf("refused send: %v, want ErrRejected", err)
			}
			// A destination too short for the payload refuses it too.
			short := func(m ucx.Message) (ucx.Admission, error) {
				return ucx.Admission{Dest: make([]byte, m.Length-1)}, nil
			}
			snd2, _, ep2 := pair(t, tr.opts, short)
			if err := snd2.Send(ctxT(t, 10*time.Second), ep2, []byte("x"), src); !errors.Is(err, ucx.ErrTruncated) {
				t.Errorf("send to a short destination: %v, want ErrTruncated", err)
			}
			// The endpoint still works after a refusal.
			if err := snd.Send(ctxT(t, 10*time.Second), ep, []byte("yes"), src); err != nil {
				t.Fatal(err)
			}
			if l := s.next(t, 10*time.Second); l.err != nil || l.hdr != "yes" {
				t.Errorf("after the refusal: %+v", l)
			}
			if st := rcv.Stats(); st.Refused != 1 || st.Admitted != 1 {
				t.Errorf("receiver stats %+v", st)
			}
		})
	}
}

// TestFenceWaitsForReceive files a 64 MiB receive under a token, revokes
// the token (Admit refuses it from then on) and fences it: the fence must
// return only after the receive's Done, and later messages under the token
// must be refused.
func TestFenceWaitsForReceive(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			skipCMA(t, tr.name)
			const tok = ucx.Token(7)
			var dead atomic.Bool
			var landed atomic.Bool
			admitted := make(chan struct{}, 1)
			dst := region(t, 64<<20)
			admit := func(m ucx.Message) (ucx.Admission, error) {
				if dead.Load() {
					return ucx.Admission{}, errors.New("revoked")
				}
				admitted <- struct{}{}
				return ucx.Admission{Dest: dst, Token: tok, Done: func(err error) {
					if err != nil {
						t.Errorf("receive: %v", err)
					}
					landed.Store(true)
				}}, nil
			}
			snd, rcv, ep := pair(t, tr.opts, admit)
			src := region(t, 64<<20)
			fill(src, 3)
			op, err := snd.Post(ep, []byte("big"), src)
			if err != nil {
				t.Fatal(err)
			}
			<-admitted
			dead.Store(true)
			inFlight := !landed.Load()
			if err := rcv.Fence(ctxT(t, 30*time.Second), tok); err != nil {
				t.Fatal(err)
			}
			if !landed.Load() {
				t.Fatal("Fence returned before the receive's Done")
			}
			t.Logf("receive still in flight when fenced: %v", inFlight)
			if crc32.Checksum(dst, castagnoli) != crc32.Checksum(src, castagnoli) {
				t.Error("the payload did not land intact")
			}
			if err := op.Wait(ctxT(t, 10*time.Second)); err != nil {
				t.Errorf("sender: %v", err)
			}
			if err := snd.Send(ctxT(t, 10*time.Second), ep, []byte("late"), src[:1<<20]); !errors.Is(err, ucx.ErrRejected) {
				t.Errorf("send after the revoke: %v, want ErrRejected", err)
			}
			// A token with nothing filed fences at once.
			if err := rcv.Fence(ctxT(t, time.Second), 999); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestHeaderOnlyAndLimits(t *testing.T) {
	s := newSink(t)
	snd, _, ep := pair(t, transports[0].opts, s.admit)
	if err := snd.Send(ctxT(t, 10*time.Second), ep, []byte("just a header"), nil); err != nil {
		t.Fatal(err)
	}
	if l := s.next(t, 10*time.Second); l.hdr != "just a header" || l.n != 0 || l.rndv || l.err != nil {
		t.Errorf("header-only message: %+v", l)
	}
	t.Logf("max header %d bytes", snd.MaxHeader())
	if snd.MaxHeader() < 1024 {
		t.Errorf("MaxHeader %d", snd.MaxHeader())
	}
	if _, err := snd.Post(ep, make([]byte, snd.MaxHeader()+1), nil); !errors.Is(err, ucx.ErrHeaderTooLarge) {
		t.Errorf("oversized header: %v", err)
	}
	big := make([]byte, snd.MaxHeader())
	big[0] = 'h'
	if err := snd.Send(ctxT(t, 10*time.Second), ep, big, []byte{1, 2, 3}); err != nil {
		t.Fatalf("max-size header: %v", err)
	}
	if l := s.next(t, 10*time.Second); len(l.hdr) != len(big) || l.n != 3 {
		t.Errorf("max-size header landed as %d header bytes, %d payload", len(l.hdr), l.n)
	}
	if op, err := snd.Post(12345, []byte("x"), nil); err != nil || !errors.Is(op.Wait(ctxT(t, time.Second)), ucx.ErrUnknownEndpoint) {
		t.Errorf("post to an unknown endpoint: %v", err)
	}
}

func TestCallbacksMustNotBlock(t *testing.T) {
	var w *ucx.Worker
	got := make(chan [3]error, 1)
	admit := func(m ucx.Message) (ucx.Admission, error) {
		return ucx.Admission{Dest: make([]byte, m.Length), Token: 2, Done: func(error) {
			_, err := w.Connect(context.Background(), []byte{1})
			got <- [3]error{w.Fence(context.Background(), 2), w.Close(), err}
		}}, nil
	}
	snd, rcv, ep := pair(t, transports[0].opts, admit)
	w = rcv
	if err := snd.Send(ctxT(t, 10*time.Second), ep, []byte("h"), []byte("payload")); err != nil {
		t.Fatal(err)
	}
	for i, err := range <-got {
		if !errors.Is(err, ucx.ErrOwner) {
			t.Errorf("blocking call %d from Done: %v, want ErrOwner", i, err)
		}
	}
}

// TestIdleDoesNotSpin measures the process's CPU time over one idle second
// with two connected workers.
func TestIdleDoesNotSpin(t *testing.T) {
	s := newSink(t)
	snd, rcv, ep := pair(t, transports[0].opts, s.admit)
	if err := snd.Send(ctxT(t, 10*time.Second), ep, []byte("warm"), make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	s.next(t, 10*time.Second)
	time.Sleep(100 * time.Millisecond)
	cpu := func() time.Duration {
		var ru unix.Rusage
		if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	s0, r0 := snd.Stats(), rcv.Stats()
	c0 := cpu()
	time.Sleep(time.Second)
	used := cpu() - c0
	s1, r1 := snd.Stats(), rcv.Stats()
	t.Logf("idle second: %v CPU; sender slept %d times (%d timeouts), receiver %d (%d)", used,
		s1.Sleeps-s0.Sleeps, s1.SleepTimeouts-s0.SleepTimeouts, r1.Sleeps-r0.Sleeps, r1.SleepTimeouts-r0.SleepTimeouts)
	if used > 50*time.Millisecond {
		t.Errorf("two idle workers used %v of CPU in a second", used)
	}
	if n := s1.Sleeps - s0.Sleeps + r1.Sleeps - r0.Sleeps; n > 60 {
		t.Errorf("the owners woke %d times in an idle second", n)
	}
}

func TestGoPanicStillRecovers(t *testing.T) {
	newWorker(t, ucx.Config{Options: transports[0].opts})
	recovered := func() (ok bool) {
		defer func() { ok = recover() != nil }()
		var p *int
		return *p == 0
	}()
	if !recovered {
		t.Fatal("a nil dereference was not recovered")
	}
}

func TestCloseIsClean(t *testing.T) {
	leakcheck.Check(t)
	before := runtime.NumGoroutine()
	admitted := make(chan struct{}, 1)
	doneErr := make(chan error, 1)
	dst := region(t, 64<<20)
	admit := func(m ucx.Message) (ucx.Admission, error) {
		admitted <- struct{}{}
		return ucx.Admission{Dest: dst, Token: 3, Done: func(err error) { doneErr <- err }}, nil
	}
	rcv, err := ucx.New(ucx.Config{Admit: admit, Options: transports[0].opts})
	if err != nil {
		t.Fatal(err)
	}
	snd, err := ucx.New(ucx.Config{Options: transports[0].opts})
	if err != nil {
		t.Fatal(err)
	}
	ep, err := snd.Connect(ctxT(t, 5*time.Second), rcv.Address())
	if err != nil {
		t.Fatal(err)
	}
	// The receiver's own endpoint back, which the message then comes by:
	// Close cuts the receive on it.
	if _, err := rcv.Connect(ctxT(t, 5*time.Second), snd.Address()); err != nil {
		t.Fatal(err)
	}
	src := region(t, 64<<20)
	op, err := snd.Post(ep, []byte("h"), src)
	if err != nil {
		t.Fatal(err)
	}
	<-admitted
	start := time.Now()
	if err := rcv.Close(); err != nil {
		t.Fatal(err)
	}
	t.Logf("receiver closed in %v with a 64 MiB receive in flight", time.Since(start))
	select {
	case err := <-doneErr:
		t.Logf("in-flight receive ended with %v", err)
	default:
		t.Fatal("Close returned before the in-flight receive's Done")
	}
	if err := rcv.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := rcv.Fence(ctxT(t, time.Second), 3); err != nil {
		t.Errorf("Fence after Close: %v", err)
	}
	if _, err := rcv.Connect(ctxT(t, time.Second), snd.Address()); !errors.Is(err, ucx.ErrClosed) {
		t.Errorf("Connect after Close: %v", err)
	}
	if _, err := rcv.Post(ep, nil, nil); !errors.Is(err, ucx.ErrClosed) {
		t.Errorf("Post after Close: %v", err)
	}
	err = op.Wait(ctxT(t, 30*time.Second))
	t.Logf("sender's op after the receiver closed: %v", err)
	if err := snd.Close(); err != nil {
		t.Fatal(err)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Logf("goroutines: %d before, %d after (leakcheck decides)", before, n)
	}
}

// ---- two processes ----

// child is a helper process: this test binary re-executed with
// UCX_TEST_HELPER set, printing lines the parent reads.
type child struct {
	cmd   *exec.Cmd
	lines chan string
	stdin io.WriteCloser
	seen  []string // every line read so far
}

func startChild(t *testing.T, role string, opts map[string]string, env ...string) *child {
	t.Helper()
	var o []string
	for k, v := range opts {
		o = append(o, k+"="+v)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append([]string{"UCX_TEST_HELPER=" + role, "UCX_TEST_OPTS=" + strings.Join(o, ";")}, env...)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, lines: make(chan string, 64), stdin: in}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	t.Cleanup(func() {
		in.Close()
		cmd.Process.Kill() //nolint:errcheck
		cmd.Wait()         //nolint:errcheck
	})
	return c
}

// expect returns the child's next line that starts with prefix.
func (c *child) expect(t *testing.T, prefix string, d time.Duration) string {
	t.Helper()
	deadline := time.After(d)
	for {
		select {
		case l, ok := <-c.lines:
			if !ok {
				t.Fatalf("child exited before %q", prefix)
			}
			c.seen = append(c.seen, l)
			if strings.HasPrefix(l, prefix) {
				return strings.TrimSpace(strings.TrimPrefix(l, prefix))
			}
		case <-deadline:
			t.Fatalf("no %q from the child within %v", prefix, d)
		}
	}
}

func helperOpts() map[string]string {
	m := map[string]string{}
	for _, kv := range strings.Split(os.Getenv("UCX_TEST_OPTS"), ";") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			m[k] = v
		}
	}
	return m
}

// helper runs a child's role:
//
//   - send: connects to UCX_TEST_PEER and sends one message per size in
//     UCX_TEST_SIZES (header "i size", payload fill(i)), printing "OP i err"
//     and the endpoint's info ("INFO" lines), then "DONE"; waits for stdin
//     to close. With UCX_TEST_BACK set it first prints "ADDR hex" and
//     waits for a line on stdin (the receiver connecting back).
//   - recv: prints "ADDR hex"; admits every message (UCX_TEST_ADMIT=stop
//     stops itself with SIGSTOP inside Admit first, kill SIGKILLs itself),
//     printing "RECV hdr crc err" when one ended.
func helper(role string) int {
	opts := helperOpts()
	ctx := context.Background()
	switch role {
	case "send":
		w, err := ucx.New(ucx.Config{Name: "child-send", Options: opts})
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		peer, _ := hex.DecodeString(os.Getenv("UCX_TEST_PEER"))
		ep, err := w.Connect(ctx, peer)
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		in := bufio.NewReader(os.Stdin)
		if os.Getenv("UCX_TEST_BACK") != "" {
			fmt.Println("ADDR", hex.EncodeToString(w.Address()))
			if _, err := in.ReadString('\n'); err != nil {
				return 1
			}
		}
		for i, s := range strings.Split(os.Getenv("UCX_TEST_SIZES"), ",") {
			n, _ := strconv.Atoi(s)
			var src []byte
			if n > 0 {
				src, err = unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
				if err != nil {
					fmt.Println("ERR", err)
					return 1
				}
			}
			fill(src, uint64(i))
			fmt.Printf("SENDING %d %d %08x\n", i, n, crc32.Checksum(src, castagnoli))
			cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			err = w.Send(cctx, ep, fmt.Appendf(nil, "%d %d", i, n), src)
			cancel()
			fmt.Printf("OP %d %v\n", i, err)
			if i == 0 {
				info, _ := w.EndpointInfo(ctx, ep)
				for _, l := range strings.Split(info, "\n") {
					fmt.Println("INFO", l)
				}
			}
		}
		fmt.Println("DONE")
		io.Copy(io.Discard, in) //nolint:errcheck
		w.Close()               //nolint:errcheck
		return 0
	case "recv":
		mode := os.Getenv("UCX_TEST_ADMIT")
		var mu sync.Mutex
		admit := func(m ucx.Message) (ucx.Admission, error) {
			switch mode {
			case "announce":
				fmt.Println("ADMITTED")
			case "stop":
				syscall.Kill(os.Getpid(), syscall.SIGSTOP) //nolint:errcheck
			case "kill":
				syscall.Kill(os.Getpid(), syscall.SIGKILL) //nolint:errcheck
			}
			h := string(m.Header)
			dst := make([]byte, m.Length)
			return ucx.Admission{Dest: dst, Token: 1, Done: func(err error) {
				mu.Lock()
				fmt.Printf("RECV %s %08x %v\n", h, crc32.Checksum(dst, castagnoli), err)
				mu.Unlock()
			}}, nil
		}
		w, err := ucx.New(ucx.Config{Name: "child-recv", Admit: admit, Options: opts})
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		fmt.Println("ADDR", hex.EncodeToString(w.Address()))
		io.Copy(io.Discard, os.Stdin) //nolint:errcheck
		w.Close()                     //nolint:errcheck
		return 0
	}
	return 2
}

func TestTwoProcessBytesLand(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			skipCMA(t, tr.name)
			s := newSink(t)
			rcv := newWorker(t, ucx.Config{Name: "parent-recv", Admit: s.admit, Options: tr.opts})
			sizes := []int{8<<20 + 5, 0, 1, 256 << 10, 16 << 20}
			var ss []string
			for _, n := range sizes {
				ss = append(ss, strconv.Itoa(n))
			}
			c := startChild(t, "send", tr.opts, "UCX_TEST_PEER="+hex.EncodeToString(rcv.Address()),
				"UCX_TEST_SIZES="+strings.Join(ss, ","))
			for i, n := range sizes {
				var idx, size int
				var crc uint32
				fmt.Sscanf(c.expect(t, "SENDING", 30*time.Second), "%d %d %x", &idx, &size, &crc)
				if st := c.expect(t, "OP", 60*time.Second); st != fmt.Sprintf("%d <nil>", i) {
					t.Fatalf("child's send %d: %s", i, st)
				}
				l := s.next(t, 10*time.Second)
				if l.err != nil || l.hdr != fmt.Sprintf("%d %d", i, n) || l.n != n || l.crc != crc {
					t.Fatalf("landed %+v; want %d bytes, crc %08x", l, n, crc)
				}
			}
			c.expect(t, "DONE", 10*time.Second)
			var info []string
			for _, l := range c.seen {
				if strings.HasPrefix(l, "INFO") {
					info = append(info, l)
				}
			}
			t.Logf("child's endpoint:\n%s", strings.Join(info, "\n"))
			joined := strings.Join(info, "\n")
			if strings.Contains(tr.name, "cma") && !strings.Contains(joined, "cma/") {
				t.Errorf("UCX_TLS=%s chose no cma lane", tr.name)
			}
		})
	}
}

// TestSenderKilledMidTransfer kills the sending process as soon as its
// 256 MiB message is admitted: the receive must end in an error within a
// bounded time, and the fence must return.
func TestSenderKilledMidTransfer(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			skipCMA(t, tr.name)
			admitted := make(chan struct{}, 1)
			ended := make(chan error, 1)
			dst := region(t, 256<<20)
			admit := func(m ucx.Message) (ucx.Admission, error) {
				admitted <- struct{}{}
				return ucx.Admission{Dest: dst, Token: 9, Done: func(err error) { ended <- err }}, nil
			}
			rcv := newWorker(t, ucx.Config{Name: "parent-recv", Admit: admit, Options: tr.opts})
			c := startChild(t, "send", tr.opts, "UCX_TEST_PEER="+hex.EncodeToString(rcv.Address()),
				fmt.Sprintf("UCX_TEST_SIZES=%d", 256<<20))
			select {
			case <-admitted:
			case <-time.After(30 * time.Second):
				t.Fatal("no message")
			}
			if err := c.cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			if err := rcv.Fence(ctxT(t, 30*time.Second), 9); err != nil {
				t.Fatalf("fence after the sender died: %v", err)
			}
			took := time.Since(killed)
			err := <-ended
			t.Logf("receive ended %v after the kill: %v", took, err)
			if err == nil {
				t.Log("(the payload had all landed before the kill took effect)")
			}
			if took > 10*time.Second {
				t.Errorf("the fence took %v after the sender died", took)
			}
		})
	}
}

// TestReceiverKilledMidTransfer: the receiving process dies inside Admit;
// the sender's operation must fail and OnPeerError fire, both in bounded
// time.
func TestReceiverKilledMidTransfer(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			skipCMA(t, tr.name)
			peerErr := make(chan error, 4)
			snd := newWorker(t, ucx.Config{Name: "parent-send", Options: tr.opts,
				OnPeerError: func(_ ucx.EndpointID, err error) { peerErr <- err }})
			c := startChild(t, "recv", tr.opts, "UCX_TEST_ADMIT=kill")
			addr, _ := hex.DecodeString(c.expect(t, "ADDR", 30*time.Second))
			ep, err := snd.Connect(ctxT(t, 10*time.Second), addr)
			if err != nil {
				t.Fatal(err)
			}
			src := region(t, 64<<20)
			start := time.Now()
			err = snd.Send(ctxT(t, 30*time.Second), ep, []byte("h"), src)
			t.Logf("send failed %v after it started: %v", time.Since(start), err)
			if !errors.Is(err, ucx.ErrPeerFailed) {
				t.Fatalf("send to a receiver that died: %v, want ErrPeerFailed", err)
			}
			select {
			case err := <-peerErr:
				t.Logf("OnPeerError %v after the send started: %v", time.Since(start), err)
				if !errors.Is(err, ucx.ErrPeerFailed) {
					t.Errorf("peer error %v does not wrap ErrPeerFailed", err)
				}
			case <-time.After(30 * time.Second):
				t.Error("no OnPeerError")
			}
			if err := snd.Send(ctxT(t, 5*time.Second), ep, []byte("h"), src[:10]); !errors.Is(err, ucx.ErrPeerFailed) {
				t.Errorf("send on the failed endpoint: %v", err)
			}
			// The dead endpoint is kept, naming its failure, until its
			// caller closes it; then it is forgotten.
			if n := snd.Stats().Endpoints; n != 1 {
				t.Errorf("endpoints before the close: %d, want 1", n)
			}
			if err := snd.CloseEndpoint(ctxT(t, 5*time.Second), ep, ucx.CloseForce); err != nil {
				t.Errorf("closing the failed endpoint: %v", err)
			}
			if n := snd.Stats().Endpoints; n != 0 {
				t.Errorf("endpoints after the close: %d, want 0", n)
			}
			if err := snd.Send(ctxT(t, 5*time.Second), ep, []byte("h"), src[:10]); !errors.Is(err, ucx.ErrUnknownEndpoint) {
				t.Errorf("send on the closed endpoint: %v, want ErrUnknownEndpoint", err)
			}
			if err := snd.CloseEndpoint(ctxT(t, 5*time.Second), ep, ucx.CloseForce); !errors.Is(err, ucx.ErrUnknownEndpoint) {
				t.Errorf("closing it again: %v, want ErrUnknownEndpoint", err)
			}
		})
	}
}

// TestConnectGivenUpLeavesNothing: a Connect whose context ends while the
// owner makes the endpoint must not leave it behind (until Close).
func TestConnectGivenUpLeavesNothing(t *testing.T) {
	rcv := newWorker(t, ucx.Config{Name: "rcv"})
	snd := newWorker(t, ucx.Config{Name: "snd"})
	made, gaveUp := 0, 0
	for i := range 400 {
		// Deadlines around what a Connect takes, so that some end while the
		// owner makes the endpoint.
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%40)*time.Microsecond)
		ep, err := snd.Connect(ctx, rcv.Address())
		cancel()
		switch {
		case err == nil:
			made++
			if err := snd.CloseEndpoint(ctxT(t, 5*time.Second), ep, ucx.CloseForce); err != nil {
				t.Fatal(err)
			}
		case errors.Is(err, context.DeadlineExceeded):
			gaveUp++
		default:
			t.Fatal(err)
		}
	}
	t.Logf("%d connects made, %d given up", made, gaveUp)
	deadline := time.Now().Add(5 * time.Second)
	for snd.Stats().Endpoints != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := snd.Stats().Endpoints; n != 0 {
		t.Errorf("%d endpoints left behind by Connects given up", n)
	}
}

// TestReceiverKilledWhileFragmentsFlow kills the receiving process 20 ms
// into a 256 MiB transfer over tcp, while the sender's fragments are in
// its socket: the sender must see the failure, not crash.
func TestReceiverKilledWhileFragmentsFlow(t *testing.T) {
	tr := transports[0]
	peerErr := make(chan error, 4)
	snd := newWorker(t, ucx.Config{Name: "parent-send", Options: tr.opts,
		OnPeerError: func(_ ucx.EndpointID, err error) { peerErr <- err }})
	c := startChild(t, "recv", tr.opts, "UCX_TEST_ADMIT=announce")
	addr, _ := hex.DecodeString(c.expect(t, "ADDR", 30*time.Second))
	ep, err := snd.Connect(ctxT(t, 10*time.Second), addr)
	if err != nil {
		t.Fatal(err)
	}
	src := region(t, 256<<20)
	op, err := snd.Post(ep, []byte("h"), src)
	if err != nil {
		t.Fatal(err)
	}
	c.expect(t, "ADMITTED", 30*time.Second)
	time.Sleep(20 * time.Millisecond)
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	err = op.Wait(ctxT(t, 30*time.Second))
	t.Logf("sender's op: %v", err)
	if err == nil {
		t.Log("(the transfer had ended before the kill)")
	} else if !errors.Is(err, ucx.ErrPeerFailed) {
		t.Errorf("op: %v, want ErrPeerFailed", err)
	}
}

// TestIdlePeerDeathReported: an endpoint with nothing in flight learns of
// its peer's death (the tcp connection closing) and reports it.
func TestIdlePeerDeathReported(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			skipCMA(t, tr.name)
			peerErr := make(chan error, 4)
			snd := newWorker(t, ucx.Config{Name: "parent-send", Options: tr.opts,
				OnPeerError: func(_ ucx.EndpointID, err error) { peerErr <- err }})
			c := startChild(t, "recv", tr.opts)
			addr, _ := hex.DecodeString(c.expect(t, "ADDR", 30*time.Second))
			ep, err := snd.Connect(ctxT(t, 10*time.Second), addr)
			if err != nil {
				t.Fatal(err)
			}
			if err := snd.Send(ctxT(t, 10*time.Second), ep, []byte("hello"), []byte("world")); err != nil {
				t.Fatal(err)
			}
			c.expect(t, "RECV hello", 10*time.Second)
			time.Sleep(50 * time.Millisecond)
			if err := c.cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			select {
			case err := <-peerErr:
				t.Logf("OnPeerError %v after the kill: %v", time.Since(killed), err)
			case <-time.After(30 * time.Second):
				t.Fatal("no OnPeerError within 30 s of the peer's death")
			}
		})
	}
}

// TestReceiverStoppedDoesNotHangSender: the receiving process freezes
// (SIGSTOP) inside Admit. The sender's wait ends at its deadline, and a
// force close of the endpoint ends the operation.
func TestReceiverStoppedDoesNotHangSender(t *testing.T) {
	tr := transports[0]
	snd := newWorker(t, ucx.Config{Name: "parent-send", Options: tr.opts})
	c := startChild(t, "recv", tr.opts, "UCX_TEST_ADMIT=stop")
	addr, _ := hex.DecodeString(c.expect(t, "ADDR", 30*time.Second))
	ep, err := snd.Connect(ctxT(t, 10*time.Second), addr)
	if err != nil {
		t.Fatal(err)
	}
	src := region(t, 64<<20)
	op, err := snd.Post(ep, []byte("h"), src)
	if err != nil {
		t.Fatal(err)
	}
	if err := op.Wait(ctxT(t, 500*time.Millisecond)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait on a frozen receiver: %v, want the deadline", err)
	}
	start := time.Now()
	if err := snd.CloseEndpoint(ctxT(t, 10*time.Second), ep, ucx.CloseForce); err != nil {
		t.Logf("force close: %v", err)
	}
	err = op.Wait(ctxT(t, 10*time.Second))
	t.Logf("op ended %v after the force close: %v", time.Since(start), err)
	if !errors.Is(err, ucx.ErrCanceled) {
		t.Errorf("op after the force close: %v, want ErrCanceled", err)
	}
	c.cmd.Process.Kill() //nolint:errcheck
}

// TestSenderStoppedFenceDeadline: over tcp the receiver copies fragments
// the sender pushes, so a frozen sender holds the receive; the fence
// gives up at its deadline, and returns once the sender resumes.
func TestSenderStoppedFenceDeadline(t *testing.T) {
	tr := transports[0]
	admitted := make(chan struct{}, 1)
	ended := make(chan error, 1)
	dst := region(t, 256<<20)
	admit := func(m ucx.Message) (ucx.Admission, error) {
		admitted <- struct{}{}
		return ucx.Admission{Dest: dst, Token: 4, Done: func(err error) { ended <- err }}, nil
	}
	rcv := newWorker(t, ucx.Config{Name: "parent-recv", Admit: admit, Options: tr.opts})
	c := startChild(t, "send", tr.opts, "UCX_TEST_PEER="+hex.EncodeToString(rcv.Address()),
		fmt.Sprintf("UCX_TEST_SIZES=%d", 256<<20))
	var crc uint32
	var i, n int
	fmt.Sscanf(c.expect(t, "SENDING", 30*time.Second), "%d %d %x", &i, &n, &crc)
	<-admitted
	if err := c.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := rcv.Fence(ctxT(t, 100*time.Millisecond), 4); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("fence with the sender frozen: %v, want the deadline", err)
		}
	}
	// The fences that gave up are no longer waited for.
	if n, err := rcv.FenceWaiters(ctxT(t, 5*time.Second), 4); n != 0 || err != nil {
		t.Errorf("%d fences still waiting after their deadlines (%v)", n, err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if err := rcv.Fence(ctxT(t, 30*time.Second), 4); err != nil {
		t.Fatalf("fence after the sender resumed: %v", err)
	}
	if err := <-ended; err != nil || crc32.Checksum(dst, castagnoli) != crc {
		t.Errorf("receive after the resume: %v (crc match %v)", err, crc32.Checksum(dst, castagnoli) == crc)
	}
}

// TestAbortEndsStalledReceive: a frozen tcp sender holds its receive; the
// receiver revokes the token, its fence times out, Abort cuts the
// connection (the receiver's own endpoint to the sender, which it
// connected before the sender sent), and the fence then returns. No byte
// lands after that, even once the sender resumes. A second Abort and the
// receiver's Close find the endpoint closed and leave it alone.
func TestAbortEndsStalledReceive(t *testing.T) {
	tr := transports[0]
	const tok = ucx.Token(5)
	var dead atomic.Bool
	admitted := make(chan struct{}, 1)
	ended := make(chan error, 1)
	dst := region(t, 256<<20)
	admit := func(m ucx.Message) (ucx.Admission, error) {
		if dead.Load() {
			return ucx.Admission{}, errors.New("revoked")
		}
		admitted <- struct{}{}
		return ucx.Admission{Dest: dst, Token: tok, Done: func(err error) { ended <- err }}, nil
	}
	rcv := newWorker(t, ucx.Config{Name: "parent-recv", Admit: admit, Options: tr.opts})
	c := startChild(t, "send", tr.opts, "UCX_TEST_PEER="+hex.EncodeToString(rcv.Address()),
		fmt.Sprintf("UCX_TEST_SIZES=%d", 256<<20), "UCX_TEST_BACK=1")
	addr, err := hex.DecodeString(c.expect(t, "ADDR", 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rcv.Connect(ctxT(t, 5*time.Second), addr); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(c.stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	<-admitted
	if err := c.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	dead.Store(true)
	if err := rcv.Fence(ctxT(t, 300*time.Millisecond), tok); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("fence with the sender frozen: %v, want the deadline", err)
	}
	start := time.Now()
	if err := rcv.Abort(ctxT(t, 5*time.Second), tok); err != nil {
		t.Fatal(err)
	}
	if err := rcv.Fence(ctxT(t, 5*time.Second), tok); err != nil {
		t.Fatalf("fence after Abort: %v", err)
	}
	err = <-ended
	t.Logf("receive ended %v after Abort: %v", time.Since(start), err)
	if err := rcv.Abort(ctxT(t, 5*time.Second), tok); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(err, ucx.ErrCanceled) {
		t.Errorf("aborted receive: %v, want ErrCanceled", err)
	}
	before := crc32.Checksum(dst, castagnoli)
	if err := c.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// The sender's op may well complete OK: over tcp it completes once its
	// fragments are sent, which says nothing of delivery.
	t.Logf("sender's op after it resumed: %s", c.expect(t, "OP", 30*time.Second))
	time.Sleep(200 * time.Millisecond)
	if crc32.Checksum(dst, castagnoli) != before {
		t.Error("bytes landed after the fence returned")
	}
}

// TestCloseLeavesStalledReceive: a receive that came by an endpoint UCX
// made (the receiver never connected back), from a sender frozen
// mid-transfer over tcp, cannot be cut: Close gives up on it after its
// grace, says so, and ends it with ErrLeaked (its destination stays
// UCX's), and a Fence waiting on its token returns ErrLeaked, not nil.
func TestCloseLeavesStalledReceive(t *testing.T) {
	tr := transports[0]
	const tok = ucx.Token(6)
	admitted := make(chan struct{}, 1)
	ended := make(chan error, 1)
	dst := region(t, 256<<20)
	admit := func(m ucx.Message) (ucx.Admission, error) {
		admitted <- struct{}{}
		return ucx.Admission{Dest: dst, Token: tok, Done: func(err error) { ended <- err }}, nil
	}
	rcv, err := ucx.New(ucx.Config{Name: "parent-recv", Admit: admit, Options: tr.opts})
	if err != nil {
		t.Fatal(err)
	}
	c := startChild(t, "send", tr.opts, "UCX_TEST_PEER="+hex.EncodeToString(rcv.Address()),
		fmt.Sprintf("UCX_TEST_SIZES=%d", 256<<20))
	<-admitted
	if err := c.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	fenced := make(chan error, 1)
	go func() { fenced <- rcv.Fence(ctxT(t, 30*time.Second), tok) }()
	time.Sleep(50 * time.Millisecond) // the Fence waits on the token's group
	err = rcv.Close()
	if err == nil || !strings.Contains(err.Error(), "1 receives never ended") {
		t.Fatalf("Close with a stalled receive it could not cut: %v", err)
	}
	if err := <-ended; !errors.Is(err, ucx.ErrLeaked) || !errors.Is(err, ucx.ErrClosed) {
		t.Errorf("the stalled receive ended with %v, want ErrLeaked", err)
	}
	if err := <-fenced; !errors.Is(err, ucx.ErrLeaked) {
		t.Errorf("Fence on its token: %v, want ErrLeaked", err)
	}
	// So does a Fence made after Close; another token has nothing in flight.
	if err := rcv.Fence(ctxT(t, 5*time.Second), tok); !errors.Is(err, ucx.ErrLeaked) {
		t.Errorf("Fence on its token after Close: %v, want ErrLeaked", err)
	}
	if err := rcv.Fence(ctxT(t, 5*time.Second), tok+1); err != nil {
		t.Errorf("Fence on another token after Close: %v, want nil", err)
	}
	if n := rcv.Stats().Endpoints; n != 0 {
		t.Errorf("endpoints kept after Close: %d", n)
	}
}

// BenchmarkAMRendezvous sends 1 MiB messages in process, one at a time
// (serial: each pays the RTS, the pull and the ATS, with the owners'
// wakeups) and eight in flight (window8).
func BenchmarkAMRendezvous(b *testing.B) {
	for _, tr := range transports {
		for _, window := range []int{1, 8} {
			name := tr.name + "/serial"
			if window > 1 {
				name = fmt.Sprintf("%s/window%d", tr.name, window)
			}
			b.Run(name, func(b *testing.B) {
				const n = 1 << 20
				dst := region(b, n*window)
				var next atomic.Uint64
				admit := func(m ucx.Message) (ucx.Admission, error) {
					i := int(next.Add(1)) % window
					return ucx.Admission{Dest: dst[i*n : (i+1)*n]}, nil
				}
				snd, _, ep := pair(b, tr.opts, admit)
				src := region(b, n*window)
				fill(src, 1)
				ctx := context.Background()
				ops := make([]*ucx.Op, window)
				b.SetBytes(n)
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					k := i % window
					if ops[k] != nil {
						if err := ops[k].Wait(ctx); err != nil {
							b.Fatal(err)
						}
					}
					op, err := snd.Post(ep, []byte("bench"), src[k*n:(k+1)*n])
					if err != nil {
						b.Fatal(err)
					}
					ops[k] = op
					i++
				}
				for _, op := range ops {
					if op != nil {
						if err := op.Wait(ctx); err != nil {
							b.Fatal(err)
						}
					}
				}
			})
		}
	}
}
