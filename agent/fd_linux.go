package agent

import (
	"fmt"

	"golang.org/x/sys/unix"
)

func closeFD(fd int) { unix.Close(fd) }

// fileKey names the file fd is, so that two fds of one file (one memfd
// passed twice) compare equal; "" when fstat fails.
func fileKey(fd int) string {
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		return ""
	}
	return fmt.Sprintf("file %d:%d", st.Dev, st.Ino)
}
