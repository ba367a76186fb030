package service

import (
	"testing"

	"github.com/handoff-io/handoff/worker/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }
