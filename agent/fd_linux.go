package agent

import "golang.org/x/sys/unix"

func closeFD(fd int) { unix.Close(fd) }

// sameFile reports whether fds a and b are one file (one memfd passed
// twice).
func sameFile(a, b int) bool {
	var sa, sb unix.Stat_t
	if unix.Fstat(a, &sa) != nil || unix.Fstat(b, &sb) != nil {
		return false
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}
