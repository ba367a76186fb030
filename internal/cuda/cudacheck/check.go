// Package cudacheck measures and verifies the CUDA data paths on a machine
// with a driver, and prints one JSON report: the loader, host<->device
// bandwidth (pinned and pageable), device-to-device bandwidth in one
// process, CUDA IPC device-to-device bandwidth from a second process
// against that baseline (goal: at least 0.8x) with checksums, IPC handle
// open latency first and cached, and a staged GPU->tcp->GPU transfer with
// checksums. cmd/cuda-check is its command and scripts/gpu-check runs it;
// its tests run it over the fake drivers so the script is known to work
// before a GPU is at hand.
package cudacheck

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"net"
	"os"
	"os/exec"
	"time"

	"github.com/handoff-io/handoff/internal/cuda"
)

// IPCGoal is the fraction of in-process D2D bandwidth that cross-process
// CUDA IPC copies must reach (issue 20).
const IPCGoal = 0.8

// Config says what to check.
type Config struct {
	Library string // the driver to load (cuda.Library)
	Device  string // ordinal or UUID
	Size    uint64 // bytes per buffer
	Repeat  int    // copies per measurement
	// Self is the command line that runs this check again as the IPC
	// child (os.Executable() and its flags); the child is told its role
	// through the environment.
	Self []string
}

// Report is the JSON summary.
type Report struct {
	OK            bool       `json:"ok"`
	Errors        []string   `json:"errors,omitempty"`
	Library       string     `json:"library"`
	DriverVersion int        `json:"driver_version"`
	Device        DeviceInfo `json:"device"`
	SizeBytes     uint64     `json:"size_bytes"`
	Repeat        int        `json:"repeat"`
	GBps          Bandwidth  `json:"gbps"`
	IPC           *IPCResult `json:"ipc,omitempty"`
	Staged        *Staged    `json:"staged_tcp,omitempty"`
	EndToEnd      string     `json:"end_to_end"`
}

// DeviceInfo names the device checked.
type DeviceInfo struct {
	Ordinal int    `json:"ordinal"`
	UUID    string `json:"uuid"`
	PCIBus  int    `json:"pci_bus"`
	DMABuf  int    `json:"dma_buf_supported"`
}

// Bandwidth is in GB/s (1e9 bytes per second of bytes copied).
type Bandwidth struct {
	H2DPinned   float64 `json:"h2d_pinned"`
	H2DPageable float64 `json:"h2d_pageable"`
	D2HPinned   float64 `json:"d2h_pinned"`
	D2HPageable float64 `json:"d2h_pageable"`
	D2D         float64 `json:"d2d_in_process"`
}

// IPCResult is the two-process check.
type IPCResult struct {
	D2DGBps       float64 `json:"d2d_gbps"`
	RatioToLocal  float64 `json:"ratio_to_in_process"`
	Goal          float64 `json:"goal"`
	MeetsGoal     bool    `json:"meets_goal"`
	ChecksumsOK   bool    `json:"checksums_ok"`
	OpenFirstUs   float64 `json:"open_first_us"`
	OpenCachedUs  float64 `json:"open_cached_us"`
	ChildReported string  `json:"child_error,omitempty"`
}

// Staged is the GPU->pinned->tcp->pinned->GPU check.
type Staged struct {
	GBps        float64 `json:"gbps"`
	ChecksumsOK bool    `json:"checksums_ok"`
}

func gbps(bytes uint64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(bytes) / d.Seconds() / 1e9
}

func pattern(n uint64, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131>>5) ^ seed
	}
	return b
}

// Run performs the checks. A failing step is recorded in Report.Errors and
// the others still run; the error is for a check that could not start.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	r := &Report{Library: cfg.Library, SizeBytes: cfg.Size, Repeat: cfg.Repeat,
		EndToEnd: "not run here: scripts/gpu-check runs the handoff with both workers in device memory (service.test TestDeviceMemoryMatchesLocal, device_oracle_rc)"}
	fail := func(step string, err error) { r.Errors = append(r.Errors, fmt.Sprintf("%s: %v", step, err)) }
	drv, err := cuda.Load(cfg.Library)
	if err != nil {
		return nil, err
	}
	if r.DriverVersion, err = drv.DriverGetVersion(); err != nil {
		return nil, err
	}
	d, err := cuda.OpenDevice(drv, cfg.Device)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	r.Device = DeviceInfo{Ordinal: d.Ordinal(), UUID: d.UUID().String()}
	_ = d.Do(func(drv cuda.Driver) error {
		dev, err := drv.DeviceGet(d.Ordinal())
		if err != nil {
			return err
		}
		r.Device.PCIBus, _ = drv.DeviceGetAttribute(cuda.DeviceAttributePCIBusID, dev)
		r.Device.DMABuf, _ = drv.DeviceGetAttribute(cuda.DeviceAttributeDMABufSupported, dev)
		return nil
	})
	if err := bandwidth(d, cfg, &r.GBps); err != nil {
		fail("bandwidth", err)
	}
	if ipc, err := ipcCheck(ctx, d, cfg, r.GBps.D2D); err != nil {
		fail("ipc", err)
	} else {
		r.IPC = ipc
		if !ipc.ChecksumsOK {
			fail("ipc", errors.New("checksums differ"))
		}
	}
	if st, err := staged(ctx, drv, cfg); err != nil {
		fail("staged tcp", err)
	} else {
		r.Staged = st
		if !st.ChecksumsOK {
			fail("staged tcp", errors.New("checksums differ"))
		}
	}
	r.OK = len(r.Errors) == 0
	return r, nil
}

func timeIt(n int, fn func() error) (time.Duration, error) {
	start := time.Now()
	for range n {
		if err := fn(); err != nil {
			return 0, err
		}
	}
	return time.Since(start), nil
}

func bandwidth(d *cuda.Device, cfg Config, bw *Bandwidth) (err error) {
	n, rep := cfg.Size, cfg.Repeat
	total := n * uint64(rep)
	a, err := d.Alloc(n)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Free(a)) }()
	b, err := d.Alloc(n)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Free(b)) }()
	pin, err := d.AllocPinned(n)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pin.Free()) }()
	pageable := pattern(n, 1)
	copy(pin.Bytes(), pageable)
	wait := func(c *cuda.Copy, err error) error {
		if err != nil {
			return err
		}
		return c.Wait()
	}
	steps := []struct {
		out *float64
		fn  func() error
	}{
		{&bw.H2DPinned, func() error { return wait(d.SubmitHtoD(a, pin.Ptr(), n)) }},
		{&bw.H2DPageable, func() error { return d.CopyToDevice(a, pageable) }},
		{&bw.D2HPinned, func() error { return wait(d.SubmitDtoH(pin.Ptr(), a, n)) }},
		{&bw.D2HPageable, func() error { return d.CopyFromDevice(pageable, a) }},
		{&bw.D2D, func() error { return wait(d.SubmitDtoD(b, a, n)) }},
	}
	for _, s := range steps {
		if err := s.fn(); err != nil { // warm up
			return err
		}
		t, err := timeIt(rep, s.fn)
		if err != nil {
			return err
		}
		*s.out = gbps(total, t)
	}
	return nil
}

// childEnv carries the IPC child's task.
const childEnv = "HANDOFF_CUDACHECK_CHILD"

type childTask struct {
	Library string         `json:"library"`
	Device  string         `json:"device"` // the exporter's UUID: the same GPU
	Buffer  cuda.IPCBuffer `json:"buffer"`
	Repeat  int            `json:"repeat"`
	Sum     uint32         `json:"sum"`  // crc32 of the exporter's bytes
	Seed    byte           `json:"seed"` // the child writes pattern(size, seed)
}

type childResult struct {
	Error        string  `json:"error,omitempty"`
	ReadSumOK    bool    `json:"read_sum_ok"`
	GBps         float64 `json:"gbps"`
	OpenFirstUs  float64 `json:"open_first_us"`
	OpenCachedUs float64 `json:"open_cached_us"`
}

func ipcCheck(ctx context.Context, d *cuda.Device, cfg Config, local float64) (res *IPCResult, err error) {
	n := cfg.Size
	p, err := d.Alloc(n)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, d.Free(p)) }()
	data := pattern(n, 7)
	if err := d.CopyToDevice(p, data); err != nil {
		return nil, err
	}
	buf, err := d.Export(p)
	if err != nil {
		return nil, err
	}
	task, _ := json.Marshal(childTask{Library: cfg.Library, Device: d.UUID().String(), Buffer: buf,
		Repeat: cfg.Repeat, Sum: crc32.ChecksumIEEE(data), Seed: 9})
	cmd := exec.CommandContext(ctx, cfg.Self[0], cfg.Self[1:]...)
	cmd.Env = append(os.Environ(), childEnv+"="+string(task))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	var cr childResult
	if jerr := json.Unmarshal(out, &cr); jerr != nil {
		return nil, fmt.Errorf("ipc child: %v (exit %v): %q", jerr, err, out)
	}
	res = &IPCResult{D2DGBps: cr.GBps, Goal: IPCGoal, OpenFirstUs: cr.OpenFirstUs, OpenCachedUs: cr.OpenCachedUs, ChildReported: cr.Error}
	if local > 0 {
		res.RatioToLocal = cr.GBps / local
		res.MeetsGoal = res.RatioToLocal >= IPCGoal
	}
	got := make([]byte, n)
	if err := d.CopyFromDevice(got, p); err != nil {
		return res, err
	}
	res.ChecksumsOK = cr.Error == "" && cr.ReadSumOK && crc32.ChecksumIEEE(got) == crc32.ChecksumIEEE(pattern(n, 9))
	return res, nil
}

// Child runs the IPC child's role and exits when this process is one;
// otherwise it returns at once. Call it first in main (and TestMain).
func Child() {
	spec, ok := os.LookupEnv(childEnv)
	if !ok {
		return
	}
	var task childTask
	res := childResult{}
	if err := json.Unmarshal([]byte(spec), &task); err != nil {
		res.Error = err.Error()
	} else if err := child(task, &res); err != nil {
		res.Error = err.Error()
	}
	_ = json.NewEncoder(os.Stdout).Encode(res)
	os.Exit(0)
}

func child(task childTask, res *childResult) (err error) {
	drv, err := cuda.Load(task.Library)
	if err != nil {
		return err
	}
	d, err := cuda.OpenDevice(drv, task.Device)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	n := task.Buffer.Size
	start := time.Now()
	remote, err := d.Import(task.Buffer)
	if err != nil {
		return fmt.Errorf("open handle: %w", err)
	}
	res.OpenFirstUs = float64(time.Since(start).Nanoseconds()) / 1e3
	const cached = 100
	t, err := timeIt(cached, func() error {
		p, err := d.Import(task.Buffer)
		if err == nil && p != remote {
			err = fmt.Errorf("cached import %#x, first %#x", p, remote)
		}
		return err
	})
	if err != nil {
		return err
	}
	res.OpenCachedUs = float64(t.Nanoseconds()) / 1e3 / cached
	got := make([]byte, n)
	if err := d.CopyFromDevice(got, remote); err != nil {
		return err
	}
	res.ReadSumOK = crc32.ChecksumIEEE(got) == task.Sum
	own, err := d.Alloc(n)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Free(own)) }()
	if err := d.CopyToDevice(own, pattern(n, task.Seed)); err != nil {
		return err
	}
	copyOnce := func() error {
		c, err := d.SubmitDtoD(remote, own, n)
		if err != nil {
			return err
		}
		return c.Wait()
	}
	if err := copyOnce(); err != nil {
		return err
	}
	t, err = timeIt(task.Repeat, copyOnce)
	if err != nil {
		return err
	}
	res.GBps = gbps(n*uint64(task.Repeat), t)
	return d.ForgetPeer(task.Buffer.PID)
}

func staged(ctx context.Context, drv cuda.Driver, cfg Config) (res *Staged, err error) {
	send, err := cuda.OpenDevice(drv, cfg.Device)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, send.Close()) }()
	recv, err := cuda.OpenDevice(drv, cfg.Device)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, recv.Close()) }()
	n := cfg.Size
	src, err := send.Alloc(n)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, send.Free(src)) }()
	dst, err := recv.Alloc(n)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, recv.Free(dst)) }()
	data := pattern(n, 3)
	if err := send.CopyToDevice(src, data); err != nil {
		return nil, err
	}
	ss, err := cuda.NewStager(send, 0)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, ss.Close()) }()
	rs, err := cuda.NewStager(recv, 0)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, rs.Close()) }()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	total := n * uint64(cfg.Repeat)
	errc := make(chan error, 1) // the sender reports once
	go func() {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			errc <- err
			return
		}
		defer c.Close()
		for range cfg.Repeat {
			if err := ss.Send(ctx, c, src, n); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	c, err := ln.Accept()
	if err != nil {
		return nil, errors.Join(err, <-errc)
	}
	defer c.Close()
	start := time.Now()
	for range cfg.Repeat {
		if err := rs.Receive(ctx, c, dst, n); err != nil {
			c.Close()
			return nil, errors.Join(err, <-errc)
		}
	}
	el := time.Since(start)
	if err := <-errc; err != nil {
		return nil, err
	}
	got := make([]byte, n)
	if err := recv.CopyFromDevice(got, dst); err != nil {
		return nil, err
	}
	return &Staged{GBps: gbps(total, el), ChecksumsOK: crc32.ChecksumIEEE(got) == crc32.ChecksumIEEE(data)}, nil
}
