// Package size reads the byte counts the binaries' flags take, with one
// grammar for all of them.
package size

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// units are the suffixes Parse accepts, matched without regard to case:
// binary with an i (KiB) or a single letter (K), decimal with a B (KB).
var units = []struct {
	suffix string
	mult   int64
}{
	{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"tib", 1 << 40},
	{"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
	{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"t", 1 << 40},
	{"b", 1},
}

// Parse reads a non-negative byte count: an integer with an optional unit,
// spaces allowed around both: "1048576", "8MiB", "8 M", "64k", "1GB", "10B".
// KiB, MiB, GiB, TiB and K, M, G, T are powers of 1024; KB, MB, GB, TB
// powers of 1000. A count that does not fit an int64 is refused.
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	lower := strings.ToLower(t)
	mult := int64(1)
	for _, u := range units {
		if strings.HasSuffix(lower, u.suffix) {
			mult = u.mult
			t = strings.TrimSpace(t[:len(t)-len(u.suffix)])
			break
		}
	}
	if t == "" {
		return 0, fmt.Errorf("size %q: no number", s)
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: want an integer with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", s)
	}
	if n < 0 {
		return 0, fmt.Errorf("size %q: negative", s)
	}
	if n > math.MaxInt64/mult {
		return 0, fmt.Errorf("size %q: too large", s)
	}
	return n * mult, nil
}
