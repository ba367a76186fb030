//go:build unix

package rdma

import (
	"crypto/tls"
	"errors"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// connBroken reports whether an idle writer connection has something to
// read, or its end, or an error pending: a receiver sends nothing
// unsolicited, so any of them means the connection was reset or closed
// while it sat in the pool. It peeks without blocking and consumes nothing.
func connBroken(c net.Conn) bool {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	broken := false
	err = raw.Read(func(fd uintptr) bool {
		var b [1]byte
		n, _, rerr := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		switch {
		case errors.Is(rerr, unix.EAGAIN), errors.Is(rerr, unix.EINTR):
		default: // a byte, the end (n == 0), or a reset
			broken = rerr != nil || n >= 0
		}
		return true // never wait for readiness
	})
	return broken || err != nil
}
