package service

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker/admin"
)

func TestPrefillPresence(t *testing.T) {
	t0 := time.Unix(1000, 0)
	type probe struct {
		at           time.Duration
		live, usable int
		want         string // ok, warn, fail
	}
	tests := []struct {
		name   string
		probes []probe
	}{
		{"unready until the first instance", []probe{{0, 0, 0, "fail"}, {time.Minute, 1, 0, "fail"}, {2 * time.Minute, 1, 1, "ok"}}},
		{"a restart within grace does not flap", []probe{{0, 1, 1, "ok"}, {5 * time.Second, 0, 0, "warn"}, {10 * time.Second, 0, 0, "warn"}, {12 * time.Second, 1, 1, "ok"}}},
		{"gone longer than grace is unready", []probe{{0, 1, 1, "ok"}, {10 * time.Second, 0, 0, "warn"}, {11 * time.Second, 0, 0, "fail"}, {20 * time.Second, 1, 1, "ok"}}},
		{"draining instances are not usable", []probe{{0, 2, 2, "ok"}, {30 * time.Second, 2, 0, "fail"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := prefillPresence{grace: 10 * time.Second}
			for i, pr := range tt.probes {
				err := p.check(t0.Add(pr.at), pr.live, pr.usable)
				var w *admin.Warning
				got := "fail"
				switch {
				case err == nil:
					got = "ok"
				case errors.As(err, &w):
					got = "warn"
				}
				require.Equal(t, pr.want, got, "probe %d: %v", i, err)
			}
		})
	}
}
