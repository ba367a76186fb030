//go:build !amd64

package crc32c

func kernels() []kernel { return nil }
