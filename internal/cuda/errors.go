package cuda

import (
	"errors"
	"fmt"
)

// Result is a CUresult: the status every driver call returns. Success is 0.
type Result int32

// The CUresult codes this package names (cuda.h, CUDA 12.6). Codes not
// listed print as their number.
const (
	Success             Result = 0
	ErrorInvalidValue   Result = 1
	ErrorOutOfMemory    Result = 2
	ErrorNotInitialized Result = 3
	ErrorDeinitialized  Result = 4
	ErrorStubLibrary    Result = 34
	ErrorInsufficient   Result = 35 // CUDA_ERROR_INSUFFICIENT_DRIVER
	ErrorNoDevice       Result = 100
	ErrorInvalidDevice  Result = 101
	ErrorInvalidContext Result = 201
	ErrorMapFailed      Result = 205
	ErrorAlreadyMapped  Result = 208
	ErrorInvalidHandle  Result = 400
	ErrorNotFound       Result = 500
	ErrorNotReady       Result = 600
	ErrorIllegalAddress Result = 700
	ErrorCtxIsDestroyed Result = 709
	ErrorNotPermitted   Result = 800
	ErrorNotSupported   Result = 801
	ErrorUnknown        Result = 999
)

var resultNames = map[Result]string{
	Success:             "CUDA_SUCCESS",
	ErrorInvalidValue:   "CUDA_ERROR_INVALID_VALUE",
	ErrorOutOfMemory:    "CUDA_ERROR_OUT_OF_MEMORY",
	ErrorNotInitialized: "CUDA_ERROR_NOT_INITIALIZED",
	ErrorDeinitialized:  "CUDA_ERROR_DEINITIALIZED",
	ErrorStubLibrary:    "CUDA_ERROR_STUB_LIBRARY",
	ErrorInsufficient:   "CUDA_ERROR_INSUFFICIENT_DRIVER",
	ErrorNoDevice:       "CUDA_ERROR_NO_DEVICE",
	ErrorInvalidDevice:  "CUDA_ERROR_INVALID_DEVICE",
	ErrorInvalidContext: "CUDA_ERROR_INVALID_CONTEXT",
	ErrorMapFailed:      "CUDA_ERROR_MAP_FAILED",
	ErrorAlreadyMapped:  "CUDA_ERROR_ALREADY_MAPPED",
	ErrorInvalidHandle:  "CUDA_ERROR_INVALID_HANDLE",
	ErrorNotFound:       "CUDA_ERROR_NOT_FOUND",
	ErrorNotReady:       "CUDA_ERROR_NOT_READY",
	ErrorIllegalAddress: "CUDA_ERROR_ILLEGAL_ADDRESS",
	ErrorCtxIsDestroyed: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
	ErrorNotPermitted:   "CUDA_ERROR_NOT_PERMITTED",
	ErrorNotSupported:   "CUDA_ERROR_NOT_SUPPORTED",
	ErrorUnknown:        "CUDA_ERROR_UNKNOWN",
}

// String returns the cuda.h name of r, or its number.
func (r Result) String() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("CUresult(%d)", int32(r))
}

// Sentinels. A driver call's failure is an *Error; errors.Is matches it
// against the sentinel of its code.
var (
	// ErrNoDriver: no usable CUDA driver. Open returns it when libcuda.so.1
	// cannot be loaded; a call answered with CUDA_ERROR_STUB_LIBRARY (the
	// toolkit's stub, never a driver) or CUDA_ERROR_NO_DEVICE matches it too,
	// so a caller falls back to host memory on errors.Is(err, ErrNoDriver).
	ErrNoDriver = errors.New("cuda: no driver")
	// ErrStubLibrary: the loaded libcuda is the toolkit's stub
	// (CUDA_ERROR_STUB_LIBRARY); it also matches ErrNoDriver.
	ErrStubLibrary = errors.New("cuda: stub library loaded instead of a driver")
	// ErrNoDevice: the driver sees no CUDA device (CUDA_ERROR_NO_DEVICE); it
	// also matches ErrNoDriver.
	ErrNoDevice = errors.New("cuda: no device")
	// ErrSymbol: the library lacks a symbol this package needs (a driver
	// too old, or not a CUDA driver); Open returns it wrapped with the name.
	ErrSymbol = errors.New("cuda: symbol not found")
	// ErrInsufficientDriver: the driver is older than the call needs.
	ErrInsufficientDriver = errors.New("cuda: driver too old")
	// ErrInvalidValue: a bad argument, among them a pointer that is not a
	// live allocation or not its base, and a double free.
	ErrInvalidValue = errors.New("cuda: invalid value")
	// ErrOutOfMemory: device or pinned host memory exhausted.
	ErrOutOfMemory = errors.New("cuda: out of memory")
	// ErrNotInitialized: a call before cuInit.
	ErrNotInitialized = errors.New("cuda: driver not initialized")
	// ErrInvalidDevice: a device ordinal that does not exist.
	ErrInvalidDevice = errors.New("cuda: invalid device")
	// ErrInvalidContext: no context current on the calling thread, or an IPC
	// handle opened in the process that exported it.
	ErrInvalidContext = errors.New("cuda: invalid context")
	// ErrInvalidHandle: a stream, event or IPC handle that is not live.
	ErrInvalidHandle = errors.New("cuda: invalid handle")
	// ErrAlreadyMapped: an IPC handle already open in this process.
	ErrAlreadyMapped = errors.New("cuda: already mapped")
	// ErrMapFailed: an IPC handle whose memory is gone (its exporter freed
	// it or exited).
	ErrMapFailed = errors.New("cuda: map failed")
	// ErrNotReady: the work an event or stream waits for is still running
	// (cuEventQuery); not a failure.
	ErrNotReady = errors.New("cuda: not ready")
	// ErrNotSupported: the device or driver does not support the call.
	ErrNotSupported = errors.New("cuda: not supported")
	// ErrClosed: a Device used after Close.
	ErrClosed = errors.New("cuda: device closed")
)

var codeSentinels = map[Result][]error{
	ErrorInvalidValue:   {ErrInvalidValue},
	ErrorOutOfMemory:    {ErrOutOfMemory},
	ErrorNotInitialized: {ErrNotInitialized},
	ErrorDeinitialized:  {ErrNotInitialized},
	ErrorStubLibrary:    {ErrStubLibrary, ErrNoDriver},
	ErrorNoDevice:       {ErrNoDevice, ErrNoDriver},
	ErrorInsufficient:   {ErrInsufficientDriver},
	ErrorInvalidDevice:  {ErrInvalidDevice},
	ErrorInvalidContext: {ErrInvalidContext},
	ErrorMapFailed:      {ErrMapFailed},
	ErrorAlreadyMapped:  {ErrAlreadyMapped},
	ErrorInvalidHandle:  {ErrInvalidHandle},
	ErrorNotReady:       {ErrNotReady},
	ErrorNotSupported:   {ErrNotSupported},
}

// Error is a driver call that did not return CUDA_SUCCESS.
type Error struct {
	Call string // the symbol called, e.g. "cuMemAlloc_v2"
	Code Result
}

func (e *Error) Error() string {
	return fmt.Sprintf("cuda: %s: %s (%d)", e.Call, e.Code, int32(e.Code))
}

// Unwrap returns the sentinels e's code matches.
func (e *Error) Unwrap() []error { return codeSentinels[e.Code] }

// Check returns nil for Success and an *Error naming call otherwise.
func Check(call string, r Result) error {
	if r == Success {
		return nil
	}
	return &Error{Call: call, Code: r}
}

// CodeOf returns the CUresult of err: Success for nil, the code of an
// *Error in its chain, ErrorUnknown otherwise.
func CodeOf(err error) Result {
	if err == nil {
		return Success
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ErrorUnknown
}
