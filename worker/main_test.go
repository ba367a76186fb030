package worker

import (
	"testing"

	"github.com/handoff-io/handoff/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }
