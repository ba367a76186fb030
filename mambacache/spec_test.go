package mambacache

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func specConfig(mbs, k int, sched string, gating, adp bool) Config {
	c := testConfig(mbs, adp)
	c.MaxDraftTokens = max(k, 8)
	c.DraftTokens = k
	s, err := ParseDraftSchedule(sched)
	if err != nil {
		panic(err)
	}
	c.DraftLenSchedule, c.AcceptanceGating = s, gating
	return c
}

// TestPaddingDraftLensTRTLLM restates TensorRT-LLM's
// _get_num_cuda_graph_padding_dummy_slots (MambaHybridCacheManagerV2) as a
// table: 1 row with speculation off; with a draft-length schedule the
// distinct lengths reachable at batch sizes up to max_batch_size, plus 0
// when the schedule leaves larger batch sizes uncovered; otherwise
// {max_draft_len}; plus 0 with acceptance-rate gating.
func TestPaddingDraftLensTRTLLM(t *testing.T) {
	tests := []struct {
		name   string
		mbs, k int
		sched  string
		gating bool
		want   []int
	}{
		{"spec off", 8, 0, "", false, []int{0}},
		{"spec off mbs 1", 1, 0, "", false, []int{0}},
		{"linear K=3", 8, 3, "", false, []int{3}},
		{"linear K=3 gated", 8, 3, "", true, []int{0, 3}},
		{"three lengths", 8, 4, "1:4,4:2,8:0", false, []int{0, 2, 4}},
		{"three lengths, mbs past the schedule", 16, 4, "1:4,4:2,8:0", false, []int{0, 2, 4}},
		{"mbs 1 reaches only the first entry", 1, 4, "1:4,4:2,8:0", false, []int{4}},
		{"mbs 3", 3, 4, "1:4,4:2,8:0", false, []int{2, 4}},
		{"mbs 4 stays covered", 4, 4, "1:4,4:2", false, []int{2, 4}},
		{"mbs 5 uncovered adds 0", 5, 4, "1:4,4:2", false, []int{0, 2, 4}},
		{"gating adds 0 to a covered schedule", 4, 4, "1:4,4:2", true, []int{0, 2, 4}},
		{"gating and a 0 entry share one row", 8, 4, "1:4,4:2,8:0", true, []int{0, 2, 4}},
		{"repeated lengths count once", 8, 3, "2:3,4:3,8:1", false, []int{1, 3}},
		{"schedule below K", 2, 4, "4:2", false, []int{2}},
		{"schedule all zero", 2, 4, "4:0", false, []int{0}},
		{"first entry above 1", 8, 4, "2:4,8:1", false, []int{1, 4}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := specConfig(tt.mbs, tt.k, tt.sched, tt.gating, true)
			require.NoError(t, c.Validate())
			require.Equal(t, tt.want, c.PaddingDraftLens(nil))
			require.Equal(t, len(tt.want), c.PaddingRows())
			require.Equal(t, len(tt.want)+1, c.ReservedRows(), "padding rows + the ADP row")
			require.Equal(t, tt.mbs+len(tt.want)+1, c.TotalRows())

			// Every reachable length has its own row, and the pool routes
			// that length's padding id there.
			p := newPool(t, c)
			seen := map[Row]bool{}
			for _, dl := range tt.want {
				r, ok := c.PaddingRowFor(dl)
				require.True(t, ok, "dl %d", dl)
				require.False(t, seen[r], "dl %d shares row %d", dl, r)
				seen[r] = true
				got, err := p.AddDummy(PaddingIDFor(dl))
				require.NoError(t, err)
				require.Equal(t, r, got)
				require.True(t, p.IsReserved(r))
				role, ok := c.RoleOf(r)
				require.True(t, ok)
				require.Equal(t, RowRole{Kind: RowPadding, DraftLen: dl}, role)
			}
			require.Equal(t, tt.mbs, p.FreeRows(), "padding never takes a real row")
			// Every batch size the scheduler can run has a padding row for
			// its draft length.
			for b := 1; b <= tt.mbs; b++ {
				dl := c.DraftLenSchedule.DraftLen(b, c.DraftTokens)
				if c.DraftTokens == 0 {
					dl = 0
				}
				_, ok := c.PaddingRowFor(dl)
				require.True(t, ok, "batch %d drafts %d and has no padding row", b, dl)
			}
		})
	}
}

// TestPaddingRowPerDraftLength is trtllm#13151's review point: one shared
// padding id or row would hand a DL=4 graph the DL=0 resources. Each length
// keeps its own row; a length the config never reaches is refused.
func TestPaddingRowPerDraftLength(t *testing.T) {
	c := specConfig(8, 4, "1:4,4:2,8:0", false, false)
	p := newPool(t, c)
	r4, err := p.AddDummy(PaddingIDFor(4))
	require.NoError(t, err)
	r0, err := p.AddDummy(PaddingIDFor(0))
	require.NoError(t, err)
	require.NotEqual(t, r4, r0)
	_, err = p.AddDummy(PaddingIDFor(3))
	require.ErrorIs(t, err, ErrNoPaddingRow)
	_, ok := p.Row(PaddingIDFor(3))
	require.False(t, ok, "a refused dummy is not mapped")
	_, err = p.Allocate(PaddingIDFor(3))
	require.ErrorIs(t, err, ErrDummyID, "still a dummy id")
	require.NoError(t, p.Free(PaddingIDFor(4)))
	require.NoError(t, p.Free(PaddingIDFor(0)))
	require.Len(t, p.FreeList(nil), 8)
	for _, r := range p.FreeList(nil) {
		require.False(t, p.IsReserved(r))
	}
}

// TestSeedScenarioWithDrafts is the seed's regression (ADP +
// max_batch_size 1 + disaggregation: the only real row is held by a request
// whose cache is in flight) with a draft-length schedule: the ADP dummy and
// the padding dummy of every reachable length still get their rows, and
// the pool holds exactly mbs·pp + |reachable lengths| (+1 for 0 where it
// applies) + 1 rows.
func TestSeedScenarioWithDrafts(t *testing.T) {
	for _, tt := range []struct {
		name   string
		mbs    int
		gating bool
		lens   []int
	}{
		{"mbs 1", 1, false, []int{4}},
		{"mbs 1 gated", 1, true, []int{0, 4}},
		{"mbs 8", 8, false, []int{0, 2, 4}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := specConfig(tt.mbs, 4, "1:4,4:2,8:0", tt.gating, true)
			c.PPSize = 1
			p := newPool(t, c)
			require.Equal(t, tt.mbs*1+len(tt.lens)+1, c.TotalRows())
			require.Equal(t, c.TotalRows()+tt.mbs, c.ArenaRows(), "one scratch row per real row")
			for i := range tt.mbs {
				_, err := p.Allocate(uint64(100 + i)) // in transfer: holds its row, not schedulable
				require.NoError(t, err)
			}
			require.Zero(t, p.FreeRows())
			for range 3 { // idle iterations
				adp, err := p.AddDummy(ADPDummyID)
				require.NoError(t, err, "the ADP dummy finds its row")
				want, _ := c.ADPRow()
				require.Equal(t, want, adp)
				for _, dl := range tt.lens {
					r, err := p.AddDummy(PaddingIDFor(dl))
					require.NoError(t, err)
					require.True(t, p.IsReserved(r))
					require.NoError(t, p.Free(PaddingIDFor(dl)))
				}
				require.NoError(t, p.Free(ADPDummyID))
				require.Zero(t, p.FreeRows(), "reserved rows never reach the free list")
			}
			require.Equal(t, tt.mbs, p.UsedRows())
		})
	}
}

// TestRowRoles checks the role of every row of an arena with every kind.
func TestRowRoles(t *testing.T) {
	c := specConfig(2, 4, "1:4,2:2,4:0", false, true)
	c.MaxBatchSize = 4 // reaches 4, 2 and 0
	c.CheckpointRows = 2
	require.NoError(t, c.Validate())
	// rows: 0-3 real | 4 ADP | 5 padding(4) | 6 padding(2) | 7 padding(0) | 8-9 checkpoint | 10-13 scratch
	want := []string{
		"real", "real", "real", "real", "adp", "padding(4)", "padding(2)", "padding(0)",
		"checkpoint", "checkpoint", "scratch", "scratch", "scratch", "scratch",
	}
	require.Equal(t, len(want), c.ArenaRows())
	p := newPool(t, c)
	for r := range c.ArenaRows() {
		role, ok := c.RoleOf(Row(r))
		require.True(t, ok)
		require.Equal(t, want[r], role.String(), "row %d", r)
		require.Equal(t, want[r] == "real", p.Transferable(Row(r)), "row %d", r)
		require.Equal(t, strings.HasPrefix(want[r], "padding") || want[r] == "adp", p.IsReserved(Row(r)), "row %d", r)
		require.Equal(t, want[r] == "checkpoint", c.IsCheckpointRow(Row(r)), "row %d", r)
	}
	_, ok := c.RoleOf(Row(c.ArenaRows()))
	require.False(t, ok)
	require.False(t, p.Transferable(Row(c.ArenaRows())))
	for r := range 4 {
		s, ok := c.ScratchRow(Row(r))
		require.True(t, ok)
		require.Equal(t, Row(10+r), s)
	}
	_, ok = c.ScratchRow(4)
	require.False(t, ok, "a reserved row has no scratch row")
	c.DraftTokens, c.DraftLenSchedule = 0, DraftSchedule{}
	_, ok = c.ScratchRow(0)
	require.False(t, ok, "no scratch without speculation")
	require.Zero(t, c.ScratchRows())
}

// sched builds a schedule without NewDraftSchedule's checks: Validate
// must refuse what is wrong on its own.
func sched(_ testing.TB, steps ...DraftStep) DraftSchedule {
	var s DraftSchedule
	s.n = uint8(copy(s.steps[:], steps))
	return s
}

func TestSpecConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"K above MaxDraftTokens", func(c *Config) { c.DraftTokens = 9 }, "DraftTokens = 9"},
		{"negative K", func(c *Config) { c.DraftTokens = -1 }, "DraftTokens = -1"},
		{"schedule above K", func(c *Config) { c.DraftLenSchedule = sched(t, DraftStep{1, 5}) }, "entry 1 1:5: mambacache: invalid draft-length schedule: draft length above DraftTokens"},
		{"schedule without spec", func(c *Config) { c.DraftTokens, c.DraftLenSchedule = 0, sched(t, DraftStep{1, 0}) }, "without speculation"},
		{"gating without spec", func(c *Config) { c.DraftTokens, c.AcceptanceGating = 0, true }, "without speculation"},
		{"unordered schedule", func(c *Config) { c.DraftLenSchedule = sched(t, DraftStep{4, 2}, DraftStep{2, 1}) }, "batch size not above"},
		{"increasing schedule", func(c *Config) { c.DraftLenSchedule = sched(t, DraftStep{1, 1}, DraftStep{2, 2}) }, "draft length above the previous"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := specConfig(4, 4, "", false, true)
			require.NoError(t, c.Validate())
			tt.mod(&c)
			err := c.Validate()
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, tt.want)
			_, err = New(c)
			require.ErrorIs(t, err, ErrInvalidConfig)
		})
	}
}

func TestParseDraftSchedule(t *testing.T) {
	tests := []struct {
		in   string
		want []DraftStep
		err  string // "" for success
	}{
		{"", nil, ""},
		{"  ", nil, ""},
		{"1:4", []DraftStep{{1, 4}}, ""},
		{"1:4,4:2,8:0", []DraftStep{{1, 4}, {4, 2}, {8, 0}}, ""},
		{" 1 : 4 , 4:2 ", []DraftStep{{1, 4}, {4, 2}}, ""},
		{"2:3,4:3", []DraftStep{{2, 3}, {4, 3}}, ""},
		{"1:4,", nil, `entry 2 "" is not batch:len`},
		{"1-4", nil, `entry 1 "1-4" is not batch:len`},
		{"0:4", nil, `entry 1 "0:4": batch size "0"`},
		{"-1:4", nil, `batch size "-1"`},
		{"1:-4", nil, `draft length "-4"`},
		{"+1:4", nil, `batch size "+1"`},
		{"1:4:2", nil, `draft length "4:2"`},
		{"x:4", nil, `batch size "x"`},
		{"1:", nil, `draft length ""`},
		{"1:0x4", nil, `draft length "0x4"`},
		{"99999999999999999999:1", nil, `batch size "99999999999999999999"`},
		{"1:2000000", nil, `draft length "2000000"`},
		{"4:2,1:4", nil, "entry 2 1:4: batch size not above the previous entry's 4"},
		{"4:2,4:1", nil, "entry 2 4:1: batch size not above"},
		{"1:2,4:3", nil, "entry 2 4:3: draft length above the previous entry's 2"},
		{strings.Repeat("1:1,", 8) + "1:1", nil, "9 entries"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseDraftSchedule(tt.in)
			if tt.err != "" {
				require.ErrorIs(t, err, ErrInvalidSchedule)
				require.ErrorContains(t, err, tt.err)
				require.Zero(t, got.Len())
				return
			}
			require.NoError(t, err)
			if tt.want == nil {
				require.Zero(t, got.Len())
			} else {
				require.Equal(t, tt.want, got.Steps())
			}
			again, err := ParseDraftSchedule(got.String())
			require.NoError(t, err)
			require.Equal(t, got, again)
		})
	}
}

func TestDraftLenByBatch(t *testing.T) {
	s, err := ParseDraftSchedule("1:4,4:2,8:0")
	require.NoError(t, err)
	want := map[int]int{1: 4, 2: 2, 3: 2, 4: 2, 5: 0, 8: 0, 9: 0, 100: 0}
	for b, dl := range want {
		require.Equal(t, dl, s.DraftLen(b, 4), "batch %d", b)
	}
	require.Equal(t, 3, s.DraftLen(1, 3), "capped at K")
	require.Equal(t, 3, DraftSchedule{}.DraftLen(50, 3), "no schedule: K")
	_, err = NewDraftSchedule(make([]DraftStep, 9)...)
	require.ErrorIs(t, err, ErrInvalidSchedule)
}

// FuzzParseDraftSchedule: the parser never panics, accepts only schedules
// that satisfy the order rules, refuses with ErrInvalidSchedule, and
// round-trips what it accepts.
func FuzzParseDraftSchedule(f *testing.F) {
	for _, s := range []string{"", "1:4", "1:4,4:2,8:0", "4:2,1:4", "1:2,4:3", "0:1", "1:", ":", ",", "1:4,,", "1:-1", "18446744073709551615:1", "1:4 ,2:3"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		s, err := ParseDraftSchedule(in)
		if err != nil {
			if !errors.Is(err, ErrInvalidSchedule) {
				t.Fatalf("%q: error %v does not wrap ErrInvalidSchedule", in, err)
			}
			return
		}
		if err := s.check(); err != nil {
			t.Fatalf("%q accepted but breaks the rules: %v", in, err)
		}
		again, err := ParseDraftSchedule(s.String())
		if err != nil || again != s {
			t.Fatalf("%q: round trip %q -> %v, %v", in, s.String(), again, err)
		}
		// Every batch size maps into the schedule's own lengths or 0.
		for b := 1; b <= 10 && s.Len() > 0; b++ {
			dl := s.DraftLen(b, 1<<20)
			ok := dl == 0
			for _, e := range s.Steps() {
				ok = ok || e.DraftLen == dl
			}
			if !ok {
				t.Fatalf("%q: batch %d drafts %d, not in the schedule", in, b, dl)
			}
		}
	})
}
