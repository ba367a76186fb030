// Package leakcheck fails a test binary that leaves goroutines behind.
package leakcheck
