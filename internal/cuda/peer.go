package cuda

import (
	"encoding/hex"
	"fmt"
	"os"
)

// MarshalText encodes the handle as 128 hex digits, for descriptors that
// travel as JSON.
func (h IpcMemHandle) MarshalText() ([]byte, error) {
	out := make([]byte, hex.EncodedLen(len(h.Reserved)))
	hex.Encode(out, h.Reserved[:])
	return out, nil
}

// UnmarshalText decodes what MarshalText wrote; anything but 128 hex digits
// is refused.
func (h *IpcMemHandle) UnmarshalText(b []byte) error {
	if len(b) != hex.EncodedLen(len(h.Reserved)) {
		return fmt.Errorf("%w: ipc handle of %d hex digits, want %d", ErrInvalidValue, len(b), hex.EncodedLen(len(h.Reserved)))
	}
	var r [64]byte
	if _, err := hex.Decode(r[:], b); err != nil {
		return fmt.Errorf("%w: ipc handle: %v", ErrInvalidValue, err)
	}
	h.Reserved = r
	return nil
}

// MarshalText encodes the UUID as String does.
func (u UUID) MarshalText() ([]byte, error) { return []byte(u.String()), nil }

// UnmarshalText decodes what ParseUUID accepts.
func (u *UUID) UnmarshalText(b []byte) error {
	v, err := ParseUUID(string(b))
	if err != nil {
		return err
	}
	*u = v
	return nil
}

// VisibleDevices lists the UUIDs of the devices this process sees, in
// ordinal order: a peer's export can be opened here only if its device is
// among them. It calls cuInit; no context is needed.
func VisibleDevices(drv Driver) ([]UUID, error) {
	if err := drv.Init(0); err != nil {
		return nil, err
	}
	n, err := drv.DeviceGetCount()
	if err != nil {
		return nil, err
	}
	out := make([]UUID, 0, n)
	for i := range n {
		d, err := drv.DeviceGet(i)
		if err != nil {
			return nil, err
		}
		u, err := drv.DeviceGetUUID(d)
		if err != nil {
			return nil, err
		}
		out = append(out, u)
	}
	return out, nil
}

// IPCNamespace names this process's IPC namespace ("ipc:[4026531839]"), or
// "" where it cannot be read. CUDA IPC works only between processes that
// share it (containers need --ipc=host or a shared one), so transport
// selection compares it with the peer's.
func IPCNamespace() string {
	s, err := os.Readlink("/proc/self/ns/ipc")
	if err != nil {
		return ""
	}
	return s
}
