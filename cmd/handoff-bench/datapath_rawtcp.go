package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// rawTCPBaseline measures a plain Go TCP connection on loopback between this
// process and a child: the writer writev(2)s the extents of one stream's
// grants from the same source layout as a run, the child reads them into its
// destination slots in turn through a buffered reader like the engine's.
// It is the engine's tcp path without frames, grants, crc32c or lanes: the
// ratio against it is what the protocol costs, or gains by striping.
func rawTCPBaseline(ctx context.Context, l layout, dur time.Duration) baseline {
	const name = "tcp_raw"
	cmdline := fmt.Sprintf("one Go TCP connection to a child process, writev of %d %s extents per grant, reads into %d slots",
		l.PerGrant, formatSize(l.Extent), l.Depth)
	gbps, err := runRawTCP(ctx, l, dur)
	if err != nil {
		return failed(name, l.Extent, cmdline, err)
	}
	return baseline{Name: name, ExtentBytes: l.Extent, GBPerS: gbps, Status: statusOK, Command: cmdline}
}

func runRawTCP(ctx context.Context, l layout, dur time.Duration) (float64, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, fmt.Errorf("locate own binary: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(ctx, dur+30*time.Second)
	defer cancel()
	child := exec.CommandContext(ctx, exe, "datapath", "--role=rawsink", "--raw-addr="+ln.Addr().String(),
		"--extent="+strconv.FormatUint(l.Extent, 10),
		"--grant-bytes="+strconv.FormatUint(l.grantBytes(), 10),
		"--depth="+strconv.Itoa(l.Depth))
	child.Stderr = os.Stderr
	child.WaitDelay = 5 * time.Second
	var out strings.Builder
	child.Stdout = &out
	if err := child.Start(); err != nil {
		return 0, err
	}
	waited := false
	defer func() {
		if !waited {
			_ = child.Process.Kill()
			_ = child.Wait()
		}
	}()
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
	stopAccept := context.AfterFunc(ctx, func() { _ = ln.Close() })
	c, err := ln.Accept()
	stopAccept()
	if ctx.Err() != nil {
		return 0, context.Cause(ctx)
	}
	if err != nil {
		return 0, fmt.Errorf("raw sink did not connect: %w", err)
	}
	defer c.Close()
	src := make([]byte, l.span())
	for i := range src {
		src[i] = byte(i * 7)
	}
	xs := l.extents(0, 0)
	vec := make([][]byte, len(xs))
	for i, x := range xs {
		vec[i] = src[x.Offset : x.Offset+x.Length]
	}
	var sent uint64
	scratch := make(net.Buffers, len(vec))
	start := time.Now()
	for time.Since(start) < dur {
		if ctx.Err() != nil {
			return 0, context.Cause(ctx)
		}
		bufs := scratch[:copy(scratch, vec)] // WriteTo consumes its vectors
		n, err := bufs.WriteTo(c)
		sent += uint64(n)
		if err != nil {
			return 0, fmt.Errorf("raw write: %w", err)
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return 0, err
	}
	err = child.Wait()
	elapsed := time.Since(start)
	waited = true
	if err != nil {
		return 0, fmt.Errorf("raw sink: %w", err)
	}
	got, err := strconv.ParseUint(strings.TrimSpace(out.String()), 10, 64)
	if err != nil || got != sent {
		return 0, fmt.Errorf("raw sink read %q bytes, %d were sent", strings.TrimSpace(out.String()), sent)
	}
	return float64(sent) / elapsed.Seconds() / 1e9, nil
}

// serveRawSink is the child of rawTCPBaseline: it reads grants' extents into
// its slots until the stream ends, then prints the bytes it read.
func serveRawSink(ctx context.Context, addr string, l layout, stdout io.Writer) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	// A signal (ctx) ends the sink at once, even inside a read.
	defer context.AfterFunc(ctx, func() { _ = c.Close() })()
	br := bufio.NewReaderSize(c, 64<<10)
	dst := make([]byte, uint64(l.Depth)*l.span())
	xs := l.extents(0, 0)
	var n uint64
	for slot := 0; ; slot = (slot + 1) % l.Depth {
		d := dst[uint64(slot)*l.span():]
		for _, x := range xs {
			k, err := io.ReadFull(br, d[x.Offset:x.Offset+x.Length])
			n += uint64(k)
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				_, err = fmt.Fprintln(stdout, n)
				return err
			}
			if err != nil {
				return err
			}
		}
	}
}
