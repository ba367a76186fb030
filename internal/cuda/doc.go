// Package cuda is handoff's binding to the CUDA driver API, without cgo and
// without the CUDA toolkit at build time.
//
// # Loading
//
// Open dlopens libcuda.so.1 at run time through github.com/ebitengine/purego
// (which links its own fakecgo, so CGO_ENABLED=0 builds keep working) and
// resolves every entry point by its versioned name (cuMemAlloc_v2,
// cuIpcOpenMemHandle_v2, ...): cuda.h renames the API to those ABIs with
// macros, and the unsuffixed symbols keep the old ones (cuMemAlloc takes a
// 32-bit size). A library that lacks one fails Open with ErrSymbol naming
// it. Without a driver, Open fails with ErrNoDriver and the caller runs in
// host memory; the toolkit's stub libcuda.so (CUDA_ERROR_STUB_LIBRARY) and
// a driver without a device (CUDA_ERROR_NO_DEVICE) match ErrNoDriver too.
//
// # Errors
//
// A CUresult other than CUDA_SUCCESS is an *Error naming the call and the
// code ("cuda: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)"); errors.Is
// matches it against the sentinel of its code (ErrOutOfMemory,
// ErrInvalidValue, ErrInvalidContext, ErrAlreadyMapped, ErrNotReady, ...).
//
// # Threads and contexts
//
// A CUDA context is current per OS thread. Device runs every call for one
// device on one executor goroutine locked to its thread, with the device's
// primary context current there; its methods queue work to that goroutine
// and wait. Copies that may outlive the call (SubmitDtoD, SubmitDtoH,
// SubmitHtoD) go on a non-blocking stream and are waited on by polling an
// event (purego callbacks are capped and never freed, so no host
// callbacks). Asynchronous host memory is pinned (Pinned), never the Go
// heap.
//
// # IPC
//
// Export describes an allocation (its base: handles name whole
// allocations) as an IPCBuffer: handle, base, size, buffer id, device UUID,
// exporter pid. Import opens it once per (exporter pid, device, base) and
// caches the mapping, reopening when the buffer id changed; a process's own
// export is its own pointer (the driver refuses to open a handle in its
// exporter).
//
// # Testing
//
// Driver is the table of entry points. Package cudafake implements it in
// Go over host memory with the driver's rules and error codes, and package
// cudatest is the conformance suite every implementation runs: the Go
// fake; this package's purego loader over a fake libcuda.so.1 built from C
// at test time (testdata/fakecuda.c: versioned symbols only, legacy names
// that fail, the 64-byte handle by value; skipped with the reason where no
// C compiler exists); and the real driver with HANDOFF_CUDA_REAL=1
// (scripts/gpu-check). The Device tests run over the same three.
package cuda
