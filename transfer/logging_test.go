package transfer

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
)

// The worker's logger already carries the instance id, so no log line of the
// drivers may name a peer under the same key.
func TestLogLinesHaveNoDuplicateKeys(t *testing.T) {
	f := newFixture(t)
	ds, ps := newSide(t, "dec", testHybrid(64, 8)), newSide(t, "pre", testHybrid(64, 8))
	var out syncBuffer
	logger := func(id string) *slog.Logger {
		return slog.New(slog.NewJSONHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", id)
	}
	d := f.decoder("d1", ds, func(c *DecoderConfig) { withRegistry(c); c.Logger = logger("d1") })
	f.prefiller("p1", f.fp, newExec(ps), func(c *PrefillerConfig) { withRegistryP(c); c.Logger = logger("p1") })
	natstest.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(out.String(), "pre-connected to decode instance") {
			return errors.New("no pre-connect logged yet")
		}
		return nil
	})
	_, err := ds.handoff(context.Background(), d, Request{ID: 1, Tokens: tokens(9), Deadline: time.Now().Add(5 * time.Second)})
	require.NoError(t, err)
	require.NoError(t, ds.m.Free(1))
	require.Contains(t, out.String(), "handoff delivered")
	require.Contains(t, out.String(), `"seq":1`, "the decode engine logs the request's seq under that key")
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		require.Empty(t, duplicateKeys(t, line), line)
	}
}
