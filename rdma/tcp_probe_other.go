//go:build !unix

package rdma

import "net"

// connBroken cannot peek here; a broken idle connection fails its write.
func connBroken(net.Conn) bool { return false }
