package cuda

import (
	"encoding/json"
	"errors"
	"runtime"
	"strings"
	"testing"
)

func TestIPCBufferJSON(t *testing.T) {
	b := IPCBuffer{Base: 0x7f0000200000, Size: 1 << 20, BufferID: 42, PID: 1234}
	for i := range b.Handle.Reserved {
		b.Handle.Reserved[i] = byte(i * 3)
	}
	b.Device = UUID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
	js, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(js), `"Device":"GPU-01020304-0506-0708-090a-0b0c0d0e0f10"`) {
		t.Errorf("uuid not as nvidia-smi prints it: %s", js)
	}
	var back IPCBuffer
	if err := json.Unmarshal(js, &back); err != nil || back != b {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	var h IpcMemHandle
	for _, bad := range []string{"", "00", strings.Repeat("zz", 64), strings.Repeat("00", 65)} {
		if err := h.UnmarshalText([]byte(bad)); !errors.Is(err, ErrInvalidValue) {
			t.Errorf("UnmarshalText(%q): %v", bad, err)
		}
	}
}

func TestIPCNamespace(t *testing.T) {
	ns := IPCNamespace()
	if runtime.GOOS == "linux" && !strings.HasPrefix(ns, "ipc:[") {
		t.Errorf("IPCNamespace() = %q", ns)
	}
}

// FuzzIpcMemHandleText: whatever UnmarshalText accepts, MarshalText writes
// back to the same handle.
func FuzzIpcMemHandleText(f *testing.F) {
	var h IpcMemHandle
	seed, _ := h.MarshalText()
	f.Add(string(seed))
	f.Add(strings.Repeat("A", 128))
	f.Add("x")
	f.Fuzz(func(t *testing.T, s string) {
		var h IpcMemHandle
		if err := h.UnmarshalText([]byte(s)); err != nil {
			return
		}
		out, _ := h.MarshalText()
		var again IpcMemHandle
		if err := again.UnmarshalText(out); err != nil || again != h {
			t.Fatalf("%q -> %x -> %v", s, h.Reserved, err)
		}
	})
}
