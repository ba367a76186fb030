package mambacache

import (
	"fmt"
	"strconv"
	"strings"
)

// DraftStep is one entry of a DraftSchedule: batch sizes up to MaxBatch
// (and above the previous entry's) draft DraftLen tokens.
type DraftStep struct {
	MaxBatch int
	DraftLen int
}

// DraftSchedule maps a step's batch size to its draft length, as
// TensorRT-LLM's draft_len_schedule: entry i covers batch sizes
// (MaxBatch[i-1], MaxBatch[i]], and a batch larger than the last MaxBatch
// drafts nothing. Entries are in strictly increasing MaxBatch order and
// non-increasing DraftLen order (a larger batch never drafts more: drafting
// pays at low batch size, where decode is memory-bound). The zero value is
// no schedule.
//
// It is a fixed array, not a slice, so that Config stays comparable with ==
// and copies without allocating.
type DraftSchedule struct {
	steps [MaxScheduleLen]DraftStep
	n     uint8
}

// MaxScheduleLen bounds the entries a schedule may hold: a schedule is a
// handful of batch-size thresholds (TensorRT-LLM's examples hold three).
const MaxScheduleLen = 8

// NewDraftSchedule returns the schedule of steps, refusing (with
// ErrInvalidSchedule) what ParseDraftSchedule refuses.
func NewDraftSchedule(steps ...DraftStep) (DraftSchedule, error) {
	var s DraftSchedule
	if len(steps) > MaxScheduleLen {
		return s, fmt.Errorf("%w: %d entries, want at most %d", ErrInvalidSchedule, len(steps), MaxScheduleLen)
	}
	s.n = uint8(copy(s.steps[:], steps))
	if err := s.check(); err != nil {
		return DraftSchedule{}, err
	}
	return s, nil
}

// Steps returns the schedule's entries (a copy).
func (s DraftSchedule) Steps() []DraftStep { return append([]DraftStep(nil), s.steps[:s.n]...) }

// Len returns the number of entries; 0 is no schedule.
func (s DraftSchedule) Len() int { return int(s.n) }

func (s *DraftSchedule) list() []DraftStep { return s.steps[:s.n] }

// ParseDraftSchedule parses "b1:d1,b2:d2,...", e.g. "1:4,4:2,8:0": batch
// sizes 1 draft 4, 2..4 draft 2, 5..8 draft 0, and larger batches 0. The
// empty string is no schedule (nil). Every malformed schedule is refused
// with an error wrapping ErrInvalidSchedule that names the entry and what
// is wrong with it: not "batch:len", a batch size below 1 or a draft
// length below 0 or not a decimal integer, batch sizes not strictly
// increasing, a draft length larger than the previous entry's, or more
// than MaxScheduleLen entries. The schedule is not checked against a number of
// speculative tokens here: Config.Validate does that.
func ParseDraftSchedule(s string) (DraftSchedule, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return DraftSchedule{}, nil
	}
	parts := strings.Split(s, ",")
	if len(parts) > MaxScheduleLen {
		return DraftSchedule{}, fmt.Errorf("%w: %d entries, want at most %d", ErrInvalidSchedule, len(parts), MaxScheduleLen)
	}
	sched := make([]DraftStep, 0, len(parts))
	for i, p := range parts {
		p = strings.TrimSpace(p)
		b, d, ok := strings.Cut(p, ":")
		if !ok {
			return DraftSchedule{}, fmt.Errorf("%w: entry %d %q is not batch:len", ErrInvalidSchedule, i+1, p)
		}
		mb, err := parseScheduleInt(b)
		if err != nil || mb < 1 {
			return DraftSchedule{}, fmt.Errorf("%w: entry %d %q: batch size %q, want an integer >= 1", ErrInvalidSchedule, i+1, p, b)
		}
		dl, err := parseScheduleInt(d)
		if err != nil || dl < 0 {
			return DraftSchedule{}, fmt.Errorf("%w: entry %d %q: draft length %q, want an integer >= 0", ErrInvalidSchedule, i+1, p, d)
		}
		sched = append(sched, DraftStep{MaxBatch: mb, DraftLen: dl})
	}
	return NewDraftSchedule(sched...)
}

func parseScheduleInt(s string) (int, error) {
	s = strings.TrimSpace(s)
	// Only plain decimal digits: no sign, no 0x, no underscores.
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, strconv.ErrSyntax
	}
	v, err := strconv.ParseInt(s, 10, 32)
	if err != nil || v > maxDim {
		return 0, strconv.ErrRange
	}
	return int(v), nil
}

// check reports the first entry that breaks the schedule's order rules.
func (s DraftSchedule) check() error {
	if s.n > MaxScheduleLen {
		return fmt.Errorf("%w: %d entries, want at most %d", ErrInvalidSchedule, s.n, MaxScheduleLen)
	}
	l := s.list()
	for i, e := range l {
		if e.MaxBatch < 1 || e.MaxBatch > maxDim || e.DraftLen < 0 || e.DraftLen > maxDim {
			return fmt.Errorf("%w: entry %d %s out of range", ErrInvalidSchedule, i+1, e)
		}
		if i == 0 {
			continue
		}
		prev := l[i-1]
		if e.MaxBatch <= prev.MaxBatch {
			return fmt.Errorf("%w: entry %d %s: batch size not above the previous entry's %d",
				ErrInvalidSchedule, i+1, e, prev.MaxBatch)
		}
		if e.DraftLen > prev.DraftLen {
			return fmt.Errorf("%w: entry %d %s: draft length above the previous entry's %d (a larger batch never drafts more)",
				ErrInvalidSchedule, i+1, e, prev.DraftLen)
		}
	}
	return nil
}

// String returns "b:d".
func (e DraftStep) String() string { return fmt.Sprintf("%d:%d", e.MaxBatch, e.DraftLen) }

// String returns the schedule in ParseDraftSchedule's syntax ("" for none).
func (s DraftSchedule) String() string {
	parts := make([]string, s.n)
	for i, e := range s.list() {
		parts[i] = e.String()
	}
	return strings.Join(parts, ",")
}

// DraftLen returns the draft length for a step of batch requests, capped
// at maxDraft: the first entry whose MaxBatch >= batch, or 0 beyond the
// last entry. With no schedule it is maxDraft.
func (s DraftSchedule) DraftLen(batch, maxDraft int) int {
	if s.n == 0 {
		return maxDraft
	}
	for _, e := range s.list() {
		if batch <= e.MaxBatch {
			return min(e.DraftLen, maxDraft)
		}
	}
	return 0
}

// reachable calls f, in increasing order, with each distinct draft length
// a step of 1..maxBatch requests reaches through the schedule's entries.
func (s DraftSchedule) reachable(maxBatch int, f func(dl int)) {
	// Draft lengths are non-increasing along the schedule, so walk it
	// backwards for increasing order and drop adjacent repeats. An entry
	// whose range starts above maxBatch is unreachable.
	last, l := -1, s.list()
	for i := len(l) - 1; i >= 0; i-- {
		lo := 1
		if i > 0 {
			lo = l[i-1].MaxBatch + 1
		}
		if lo > maxBatch || l[i].DraftLen == last {
			continue
		}
		last = l[i].DraftLen
		f(last)
	}
}

// uncovered reports whether batch sizes up to maxBatch run past the last
// entry, where the draft length is 0.
func (s DraftSchedule) uncovered(maxBatch int) bool {
	return s.n > 0 && maxBatch > s.steps[s.n-1].MaxBatch
}
