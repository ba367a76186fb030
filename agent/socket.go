package agent

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// socket is the local API's listening socket and the file it is bound to.
type socket struct {
	*net.UnixListener
	path     string
	dev, ino uint64 // of the file at path once it was renamed there
	lock     int    // the held lock on path.lock
	once     sync.Once
}

// listen creates the local API's socket at path: its directory is created
// mode 0700 if missing and must be ours and private (no group or other
// bits), a stale socket file is removed (one a live agent answers on is
// refused: ErrSocketInUse), and the socket is mode 0600.
func listen(path string) (*socket, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: socket directory: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return nil, fmt.Errorf("agent: socket directory: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Uid != uint32(os.Getuid()) || st.Mode&0o077 != 0 {
		return nil, fmt.Errorf("%w: %s (mode %o, owner %d; want a 0700 directory of uid %d)", ErrUnsafeSocketDir, dir, st.Mode&0o777, st.Uid, os.Getuid())
	}
	// The lock makes taking the path one step: two agents of one name
	// starting at once would both find no live socket, and the second
	// rename would take the first's path from under it. The kernel lets
	// it go with its process; the file stays.
	lock, err := unix.Open(path+".lock", unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("agent: socket lock: %w", err)
	}
	if err := unix.Flock(lock, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		unix.Close(lock)
		if err == unix.EWOULDBLOCK {
			return nil, fmt.Errorf("%w: %s (locked)", ErrSocketInUse, path)
		}
		return nil, fmt.Errorf("agent: socket lock: %w", err)
	}
	unlock := func() { unix.Close(lock) }
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		unlock()
		return nil, fmt.Errorf("%w: %s", ErrSocketInUse, path)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		unlock()
		return nil, fmt.Errorf("agent: remove stale socket: %w", err)
	}
	// Bind a temporary name and rename it into place once listening and
	// mode 0600: an engine never finds the socket before it can connect,
	// nor while another user could.
	tmp := fmt.Sprintf("%s.%d.tmp", path, os.Getpid())
	os.Remove(tmp)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		unlock()
		return nil, fmt.Errorf("agent: listen: %w", err)
	}
	ln.SetUnlinkOnClose(false) // socket.remove removes path
	fail := func(what string, err error) (*socket, error) {
		ln.Close()
		os.Remove(tmp)
		unlock()
		return nil, fmt.Errorf("agent: %s: %w", what, err)
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail("chmod socket", err)
	}
	if err := unix.Lstat(tmp, &st); err != nil {
		return fail("socket", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail("socket", err)
	}
	return &socket{UnixListener: ln, path: path, dev: st.Dev, ino: st.Ino, lock: lock}, nil
}

// remove removes the socket's file unless another agent's socket has
// replaced it, and lets the lock go; once only.
func (s *socket) remove() {
	s.once.Do(func() {
		var st unix.Stat_t
		if err := unix.Lstat(s.path, &st); err == nil && st.Dev == s.dev && st.Ino == s.ino {
			os.Remove(s.path)
		}
		unix.Close(s.lock)
	})
}

// peerCred returns the connecting process's credentials (SO_PEERCRED).
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if serr != nil {
		return nil, fmt.Errorf("agent: SO_PEERCRED: %w", serr)
	}
	return cred, nil
}

// maxQueuedFDs bounds the descriptors a connection may pass ahead of the
// message that uses them; past it the connection is closed. It is the
// kernel's limit for one message (SCM_MAX_FD), so one registration passes
// at most that many buffers of host memory.
const maxQueuedFDs = 253

// fdConn reads a unix connection with recvmsg, keeping the descriptors
// that arrive with the bytes (SCM_RIGHTS) in order for the message that
// names them. Read runs on one goroutine; take and close may run on others.
type fdConn struct {
	c   *net.UnixConn
	oob []byte

	mu  sync.Mutex
	fds []int
}

func newFDConn(c *net.UnixConn) *fdConn {
	return &fdConn{c: c, oob: make([]byte, unix.CmsgSpace(4*maxQueuedFDs))}
}

func (f *fdConn) Read(p []byte) (int, error) {
	n, oobn, flags, _, err := f.c.ReadMsgUnix(p, f.oob)
	n = max(n, 0) // -1 with an error
	if oobn > 0 {
		if perr := f.keep(f.oob[:oobn]); perr != nil {
			return 0, perr
		}
	}
	if flags&unix.MSG_CTRUNC != 0 {
		// The kernel dropped descriptors that did not fit: the message
		// that names them cannot be served, nor the ones after it.
		return 0, fmt.Errorf("%w: more than %d descriptors passed at once", ErrBadRequest, maxQueuedFDs)
	}
	return n, err
}

// keep parses control messages and queues the descriptors they carry.
func (f *fdConn) keep(oob []byte) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return fmt.Errorf("%w: control message: %w", ErrBadRequest, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		f.fds = append(f.fds, fds...)
	}
	if len(f.fds) > maxQueuedFDs {
		return fmt.Errorf("%w: %d descriptors passed ahead of their message", ErrBadRequest, len(f.fds))
	}
	return nil
}

// take removes the n oldest queued descriptors; the caller owns them.
func (f *fdConn) take(n int) ([]int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.fds) < n {
		// Those passed belong to no message now: a retry must not take them.
		got := len(f.fds)
		f.closeQueued()
		return nil, fmt.Errorf("%w: %d descriptors expected, %d passed", ErrBadRequest, n, got)
	}
	out := f.fds[:n:n]
	f.fds = f.fds[n:]
	return out, nil
}

// queued is how many descriptors wait for a message to take them.
func (f *fdConn) queued() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.fds)
}

// closeFDs closes the descriptors no message took.
func (f *fdConn) closeFDs() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closeQueued()
}

// closeQueued closes the queued descriptors; f.mu is held.
func (f *fdConn) closeQueued() {
	for _, fd := range f.fds {
		unix.Close(fd)
	}
	f.fds = nil
}
