package cuda

import (
	"errors"
	"fmt"
	"testing"
)

func TestErrorMatching(t *testing.T) {
	for _, c := range []struct {
		code Result
		want []error
	}{
		{ErrorStubLibrary, []error{ErrStubLibrary, ErrNoDriver}},
		{ErrorNoDevice, []error{ErrNoDevice, ErrNoDriver}},
		{ErrorOutOfMemory, []error{ErrOutOfMemory}},
		{ErrorInvalidContext, []error{ErrInvalidContext}},
		{ErrorAlreadyMapped, []error{ErrAlreadyMapped}},
		{ErrorNotReady, []error{ErrNotReady}},
	} {
		err := fmt.Errorf("wrapped: %w", Check("cuX", c.code))
		for _, w := range c.want {
			if !errors.Is(err, w) {
				t.Errorf("%v does not match %v", err, w)
			}
		}
		if errors.Is(err, ErrInvalidValue) {
			t.Errorf("%v matches ErrInvalidValue", err)
		}
		if CodeOf(err) != c.code {
			t.Errorf("CodeOf(%v) = %v", err, CodeOf(err))
		}
	}
	if Check("cuX", Success) != nil || CodeOf(nil) != Success {
		t.Error("success is not nil")
	}
	if s := Result(12345).String(); s != "CUresult(12345)" {
		t.Errorf("unnamed code prints %q", s)
	}
}

func TestUUID(t *testing.T) {
	u := UUID{0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	s := u.String()
	if s != "GPU-deadbeef-0102-0304-0506-0708090a0b0c" {
		t.Fatalf("String: %s", s)
	}
	for _, in := range []string{s, s[4:], "GPU-DEADBEEF-0102-0304-0506-0708090A0B0C"} {
		if got, err := ParseUUID(in); err != nil || got != u {
			t.Errorf("ParseUUID(%q) = %v, %v", in, got, err)
		}
	}
	for _, bad := range []string{"", "GPU-", "GPU-deadbeef", "GPU-zzadbeef-0102-0304-0506-0708090a0b0c", s + "00"} {
		if _, err := ParseUUID(bad); !errors.Is(err, ErrInvalidValue) {
			t.Errorf("ParseUUID(%q): %v", bad, err)
		}
	}
}

// FuzzParseUUID: whatever it accepts prints back to the same UUID.
func FuzzParseUUID(f *testing.F) {
	f.Add("GPU-deadbeef-0102-0304-0506-0708090a0b0c")
	f.Add("deadbeef01020304050607080 90a0b0c")
	f.Add("GPU--")
	f.Fuzz(func(t *testing.T, s string) {
		u, err := ParseUUID(s)
		if err != nil {
			return
		}
		back, err := ParseUUID(u.String())
		if err != nil || back != u {
			t.Fatalf("%q -> %v -> %v, %v", s, u, back, err)
		}
	})
}
