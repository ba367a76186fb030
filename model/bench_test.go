package model_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/model"
)

func benchPrefill(b *testing.B, name string, n int) {
	e := lookup(b, name)
	spec := e.Spec()
	blocks := (n + spec.KV.TokensPerBlock) / spec.KV.TokensPerBlock
	a := newArenas(b, spec, blocks, 1)
	c := a.cache(0, blockRange(0, blocks)...)
	toks := prompt(n, 1)
	m := a.mamba
	b.SetBytes(m.RowBytes() + int64(n)*a.kv.BlockBytes()/int64(a.kv.TokensPerBlock))
	b.ReportAllocs()
	start := cpuTime()
	for b.Loop() {
		_, err := e.Prefill(c, toks)
		require.NoError(b, err)
	}
	reportCPU(b, start)
}

func benchDecode(b *testing.B, name string, n int) {
	e := lookup(b, name)
	spec := e.Spec()
	blocks := (n + spec.KV.TokensPerBlock) / spec.KV.TokensPerBlock
	a := newArenas(b, spec, blocks, 1)
	c := a.cache(0, blockRange(0, blocks)...)
	_, err := e.Prefill(c, prompt(n, 1))
	require.NoError(b, err)
	b.SetBytes(a.mamba.RowBytes())
	b.ReportAllocs()
	start := cpuTime()
	for b.Loop() {
		// Decoding the same position again is a fixed amount of work.
		_, err := e.Decode(c, 'a', n)
		require.NoError(b, err)
	}
	reportCPU(b, start)
}

func BenchmarkTinyPrefill256(b *testing.B)        { benchPrefill(b, model.TinyHybrid, 256) }
func BenchmarkTinyDecode(b *testing.B)            { benchDecode(b, model.TinyHybrid, 256) }
func BenchmarkNemotronH8BPrefill256(b *testing.B) { benchPrefill(b, model.NemotronH8B, 256) }
func BenchmarkNemotronH8BDecode(b *testing.B)     { benchDecode(b, model.NemotronH8B, 256) }
func BenchmarkQwen3Next80BDecode(b *testing.B)    { benchDecode(b, model.Qwen3Next80B, 256) }

func BenchmarkSample(b *testing.B) {
	logits := make([]float32, model.ByteVocab)
	for i := range logits {
		logits[i] = float32(i%17) * 0.3
	}
	b.ReportAllocs()
	step := 0
	for b.Loop() {
		model.Sample(logits, 0.7, 1, step)
		step++
	}
}

// cpuTime is this process's user+system CPU time. Benchmarks report it per op
// next to wall time, which a busy machine inflates.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
}
