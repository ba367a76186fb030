package model

import (
	"context"
	"fmt"
	"time"
)

// delayed adds a simulated compute time to an executor: prefill sleeps
// len(tokens)*prefill, decode sleeps decode, both before touching the cache,
// so a cancelled call leaves the cache as it was.
type delayed struct {
	inner   Executor
	prefill time.Duration
	decode  time.Duration
}

var _ ContextExecutor = (*delayed)(nil)

func (d *delayed) Spec() Spec { return d.inner.Spec() }

func (d *delayed) Prefill(c Cache, tokens []int32) ([]float32, error) {
	return d.PrefillContext(context.Background(), c, tokens)
}

func (d *delayed) Decode(c Cache, token int32, pos int) ([]float32, error) {
	return d.DecodeContext(context.Background(), c, token, pos)
}

func (d *delayed) PrefillContext(ctx context.Context, c Cache, tokens []int32) ([]float32, error) {
	if err := sleep(ctx, time.Duration(len(tokens))*d.prefill); err != nil {
		return nil, fmt.Errorf("model: prefill: %w", err)
	}
	return d.inner.Prefill(c, tokens)
}

func (d *delayed) DecodeContext(ctx context.Context, c Cache, token int32, pos int) ([]float32, error) {
	if err := sleep(ctx, d.decode); err != nil {
		return nil, fmt.Errorf("model: decode: %w", err)
	}
	return d.inner.Decode(c, token, pos)
}

func sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil || d <= 0 {
		return err
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

var _ chunker = (*delayed)(nil)

// prefillChunk spreads the chunk's simulated compute over its layers:
// layer i is reported done after its share of (to-from)*prefill, so a
// caller that ships each layer as it is done overlaps that with the
// layers still "computing", as it would with a real model.
func (d *delayed) prefillChunk(ctx context.Context, c Cache, tokens []int32, from, to int, done func(layer int) error) ([]float32, error) {
	ch, ok := d.inner.(chunker)
	if !ok {
		return nil, fmt.Errorf("%w: %s prefills whole prompts only", ErrInvalidOption, d.inner.Spec().Name)
	}
	return ch.prefillChunk(ctx, c, tokens, from, to, paced(ctx, time.Duration(to-from)*d.prefill, len(d.inner.Spec().LayerPattern), done))
}

// paced returns done delayed by layer i's share of total: layer i is
// reported total*(i+1)/layers after the first layer began.
func paced(ctx context.Context, total time.Duration, layers int, done func(layer int) error) func(int) error {
	if total <= 0 || layers <= 0 {
		return done
	}
	n := time.Duration(layers)
	return func(layer int) error {
		i := time.Duration(layer)
		if err := sleep(ctx, total*(i+1)/n-total*i/n); err != nil {
			return fmt.Errorf("model: prefill: %w", err)
		}
		return done(layer)
	}
}
