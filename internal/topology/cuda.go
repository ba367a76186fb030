package topology

import "strings"

// A CUDA device is named by its UUID across processes and tools: CUDA
// ordinals are renumbered by CUDA_VISIBLE_DEVICES (and differ from NVML's
// indices, which are not), so a process that opened "CUDA device 0" finds
// its NVML GPU, and the NIC closest to it, by UUID.

// GPUByUUID returns the GPU whose UUID is uuid, as the CUDA driver or
// nvidia-smi prints it ("GPU-" and 32 hex digits in groups; case does not
// matter, nor does the "GPU-" prefix).
func (t Host) GPUByUUID(uuid string) (GPU, bool) {
	want := normalizeGPUUUID(uuid)
	if want == "" {
		return GPU{}, false
	}
	for _, g := range t.GPUs {
		if normalizeGPUUUID(g.UUID) == want {
			return g, true
		}
	}
	return GPU{}, false
}

// BestNICForUUID is BestNIC for the GPU with the given UUID: the NIC a tcp
// transport staging that GPU's memory should use.
func (t Host) BestNICForUUID(uuid string, rdmaOnly bool) (NICAffinity, bool) {
	g, ok := t.GPUByUUID(uuid)
	if !ok {
		return NICAffinity{}, false
	}
	return t.BestNIC(g.Index, rdmaOnly)
}

// normalizeGPUUUID lower-cases uuid and drops the "GPU-" prefix; MIG
// instance UUIDs ("MIG-...") are left whole so they never equal a GPU's.
func normalizeGPUUUID(uuid string) string {
	u := strings.ToLower(strings.TrimSpace(uuid))
	return strings.TrimPrefix(u, "gpu-")
}
