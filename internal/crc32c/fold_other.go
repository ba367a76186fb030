//go:build !amd64

package crc32c

import "hash/crc32"

const haveFold = false

func updateFold(crc uint32, p []byte) uint32 { return crc32.Update(crc, table, p) }

func copyUpdateFold(crc uint32, dst, src []byte) uint32 {
	copy(dst, src)
	return crc32.Update(crc, table, src)
}

// Kernel names the implementation long inputs use on this core.
func Kernel() string { return "hash/crc32" }
