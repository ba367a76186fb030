//go:build linux

package cudafake

// Virtual memory management: handles of memfd-backed memory, exported and
// imported as fds, mapped into reserved ranges (the package comment gives
// the rules).

import (
	"encoding/hex"
	"fmt"
	"os"
	"sort"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/handoff-io/handoff/internal/cuda"
)

// Granularity is the VMM allocation granularity of every fake device
// (cuMemGetAllocationGranularity), that of current GPUs.
const Granularity = 2 << 20

// vmmName starts the name of every VMM memfd, in this fake and the C one:
// an import recognises an export by it.
const vmmName = "fakecuda-vmm-"

// vmem is VMM physical memory as this driver holds it: alive while a
// handle or a mapping names it.
type vmem struct {
	fd    int // a memfd
	inode uint64
	size  uint64
	on    int  // the device it is on
	refs  int  // handles and mappings
	owned bool // created here, so counted in on's used bytes
}

type vhandle struct {
	m   *vmem
	dev int // of the context that created or imported it
}

// vrange is a reservation. Its host side is a PROT_NONE range of the same
// size that mappings replace with their memfd, so that adjacent mappings
// are contiguous memory to a copy, as on a GPU.
type vrange struct {
	base, size uint64
	dev        int
	host       unsafe.Pointer
	maps       []*vmap // sorted by base
}

type vmap struct {
	base, size uint64
	m          *vmem
	dev        int
	bufferID   uint64
	access     []bool // per granule: cuMemSetAccess covered it
}

// vrangeOf returns the reservation holding [p, p+n), or nil.
func (d *Driver) vrangeOf(p, n uint64) *vrange {
	for _, r := range d.reserved {
		if p >= r.base && p-r.base < r.size && n <= r.base+r.size-p {
			return r
		}
	}
	return nil
}

// vmapAt returns the mapping holding p and its reservation, or nils.
func (d *Driver) vmapAt(p uint64) (*vrange, *vmap) {
	r := d.vrangeOf(p, 1)
	if r == nil {
		return nil, nil
	}
	for _, m := range r.maps {
		if p >= m.base && p-m.base < m.size {
			return r, m
		}
	}
	return r, nil
}

// covered reports whether every granule of [p, p+n) in r is mapped and,
// with access, accessible.
func (r *vrange) covered(p, n uint64, access bool) bool {
	lo, hi := p&^(Granularity-1), p+n
	for g := lo; g < hi; g += Granularity {
		var m *vmap
		for _, x := range r.maps {
			if g >= x.base && g-x.base < x.size {
				m = x
				break
			}
		}
		if m == nil || access && !m.access[(g-m.base)/Granularity] {
			return false
		}
	}
	return true
}

func (r *vrange) bytes(p, n uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(r.host, p-r.base)), n)
}

// vbytes returns the mapped bytes [p, p+n), or nil.
func (d *Driver) vbytes(p, n uint64) []byte {
	r := d.vrangeOf(p, max(n, 1))
	if r == nil || !r.covered(p, max(n, 1), true) {
		return nil
	}
	return r.bytes(p, n)
}

func (d *Driver) unref(m *vmem) {
	m.refs--
	if m.refs > 0 {
		return
	}
	_ = unix.Close(m.fd)
	if m.owned {
		d.devs[m.on].used -= m.size
	}
}

// unmap puts r's PROT_NONE host range back under m.
func (d *Driver) unmap(r *vrange, m *vmap) {
	_, _ = unix.MmapPtr(-1, 0, unsafe.Add(r.host, m.base-r.base), uintptr(m.size),
		unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED)
	for i, x := range r.maps {
		if x == m {
			r.maps = append(r.maps[:i], r.maps[i+1:]...)
			break
		}
	}
	d.unref(m.m)
}

// releaseVMM frees what the context of device dv made: its mappings
// (and every mapping in its reservations), reservations and handles.
func (d *Driver) releaseVMM(dv int) {
	kept := d.reserved[:0]
	for _, r := range d.reserved {
		for _, m := range append([]*vmap(nil), r.maps...) {
			if m.dev == dv || r.dev == dv {
				d.unmap(r, m)
			}
		}
		if r.dev == dv {
			_ = unix.MunmapPtr(r.host, uintptr(r.size))
			continue
		}
		kept = append(kept, r)
	}
	clear(d.reserved[len(kept):])
	d.reserved = kept
	for h, x := range d.handles {
		if x.dev == dv {
			delete(d.handles, h)
			d.unref(x.m)
		}
	}
}

// granules reports whether n is a non-zero multiple of the granularity.
func granules(n uint64) bool { return n > 0 && n%Granularity == 0 }

func (d *Driver) MemGetAllocationGranularity(dv cuda.Dev) (uint64, error) {
	const call = "cuMemGetAllocationGranularity"
	if err := d.enter(call); err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if _, err := d.dev(call, dv); err != nil {
		return 0, err
	}
	return Granularity, nil
}

func (d *Driver) MemCreate(size uint64, dv cuda.Dev) (cuda.MemHandle, error) {
	const call = "cuMemCreate"
	dev, err := d.enterCtx(call)
	if err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	x, err := d.dev(call, dv)
	if err != nil {
		return 0, err
	}
	if !granules(size) {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	if size > d.cfg.MemLimit-x.used {
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	fd, err := unix.MemfdCreate(vmmName+hex.EncodeToString(x.uuid[:]), unix.MFD_CLOEXEC)
	if err != nil {
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	var st unix.Stat_t
	if unix.Ftruncate(fd, int64(size)) != nil || unix.Fstat(fd, &st) != nil {
		unix.Close(fd)
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	x.used += size
	m := &vmem{fd: fd, inode: st.Ino, size: size, on: int(dv), refs: 1, owned: true}
	return d.newHandle(m, dev), nil
}

func (d *Driver) newHandle(m *vmem, dev int) cuda.MemHandle {
	d.nextH += 0x10
	h := cuda.MemHandle(d.nextH)
	d.handles[h] = &vhandle{m: m, dev: dev}
	return h
}

func (d *Driver) MemRelease(h cuda.MemHandle) error {
	const call = "cuMemRelease"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	x := d.handles[h]
	if x == nil {
		return fail(call, cuda.ErrorInvalidValue)
	}
	delete(d.handles, h)
	d.unref(x.m)
	return nil
}

func (d *Driver) MemExportToShareableHandle(h cuda.MemHandle) (int, error) {
	const call = "cuMemExportToShareableHandle"
	if _, err := d.enterCtx(call); err != nil {
		return -1, err
	}
	defer d.mu.Unlock()
	x := d.handles[h]
	if x == nil {
		return -1, fail(call, cuda.ErrorInvalidValue)
	}
	fd, err := unix.FcntlInt(uintptr(x.m.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fail(call, cuda.ErrorOutOfMemory)
	}
	return fd, nil
}

func (d *Driver) MemImportFromShareableHandle(fd int) (cuda.MemHandle, error) {
	const call = "cuMemImportFromShareableHandle"
	dev, err := d.enterCtx(call)
	if err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if fd < 0 {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	name, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	uuid, ok := strings.CutPrefix(name, "/memfd:"+vmmName)
	var st unix.Stat_t
	if err != nil || !ok || unix.Fstat(fd, &st) != nil || !granules(uint64(st.Size)) {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	// The same memory imported again, or an export of this driver's own,
	// is one allocation with one more handle.
	for _, x := range d.handles {
		if x.m.inode == st.Ino {
			x.m.refs++
			return d.newHandle(x.m, dev), nil
		}
	}
	for _, r := range d.reserved {
		for _, m := range r.maps {
			if m.m.inode == st.Ino {
				m.m.refs++
				return d.newHandle(m.m, dev), nil
			}
		}
	}
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	// The memory stays on the exporter's device where this process sees
	// it, as for IPC handles.
	on := dev
	uuid, _, _ = strings.Cut(uuid, " ")
	for i, x := range d.devs {
		if uuid == hex.EncodeToString(x.uuid[:]) {
			on = i
		}
	}
	m := &vmem{fd: own, inode: st.Ino, size: uint64(st.Size), on: on, refs: 1}
	return d.newHandle(m, dev), nil
}

func (d *Driver) MemAddressReserve(size, align uint64) (cuda.DevicePtr, error) {
	const call = "cuMemAddressReserve"
	dev, err := d.enterCtx(call)
	if err != nil {
		return 0, err
	}
	defer d.mu.Unlock()
	if !granules(size) || align != 0 && (align%Granularity != 0 || align&(align-1) != 0) {
		return 0, fail(call, cuda.ErrorInvalidValue)
	}
	host, err := unix.MmapPtr(-1, 0, nil, uintptr(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, fail(call, cuda.ErrorOutOfMemory)
	}
	if align > 0 {
		d.nextAddr = (d.nextAddr + align - 1) &^ (align - 1)
	}
	r := &vrange{base: d.reserve(size), size: size, dev: dev, host: host}
	d.reserved = append(d.reserved, r)
	return cuda.DevicePtr(r.base), nil
}

func (d *Driver) MemAddressFree(p cuda.DevicePtr, size uint64) error {
	const call = "cuMemAddressFree"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	for i, r := range d.reserved {
		if r.base == uint64(p) && r.size == size && len(r.maps) == 0 {
			_ = unix.MunmapPtr(r.host, uintptr(r.size))
			d.reserved = append(d.reserved[:i], d.reserved[i+1:]...)
			return nil
		}
	}
	return fail(call, cuda.ErrorInvalidValue)
}

func (d *Driver) MemMap(p cuda.DevicePtr, size uint64, h cuda.MemHandle) error {
	const call = "cuMemMap"
	dev, err := d.enterCtx(call)
	if err != nil {
		return err
	}
	defer d.mu.Unlock()
	x := d.handles[h]
	if x == nil || !granules(size) || uint64(p)%Granularity != 0 || size > x.m.size {
		return fail(call, cuda.ErrorInvalidValue)
	}
	r := d.vrangeOf(uint64(p), size)
	if r == nil {
		return fail(call, cuda.ErrorInvalidValue)
	}
	for _, m := range r.maps {
		if uint64(p) < m.base+m.size && m.base < uint64(p)+size {
			return fail(call, cuda.ErrorInvalidValue)
		}
	}
	_, err = unix.MmapPtr(x.m.fd, 0, unsafe.Add(r.host, uint64(p)-r.base), uintptr(size),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED)
	if err != nil {
		return fail(call, cuda.ErrorOutOfMemory)
	}
	x.m.refs++
	d.nextBuf++
	m := &vmap{base: uint64(p), size: size, m: x.m, dev: dev, bufferID: d.nextBuf, access: make([]bool, size/Granularity)}
	i := sort.Search(len(r.maps), func(i int) bool { return r.maps[i].base > m.base })
	r.maps = append(r.maps, nil)
	copy(r.maps[i+1:], r.maps[i:])
	r.maps[i] = m
	return nil
}

func (d *Driver) MemUnmap(p cuda.DevicePtr, size uint64) error {
	const call = "cuMemUnmap"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	r, m := d.vmapAt(uint64(p))
	if m == nil || m.base != uint64(p) || m.size != size {
		return fail(call, cuda.ErrorInvalidValue)
	}
	d.drainAll() // copies in flight finish before the memory goes, as for cuMemFree
	d.unmap(r, m)
	return nil
}

func (d *Driver) MemSetAccess(p cuda.DevicePtr, size uint64, dv cuda.Dev) error {
	const call = "cuMemSetAccess"
	if _, err := d.enterCtx(call); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if _, err := d.dev(call, dv); err != nil {
		return err
	}
	if !granules(size) || uint64(p)%Granularity != 0 {
		return fail(call, cuda.ErrorInvalidValue)
	}
	r := d.vrangeOf(uint64(p), size)
	if r == nil || !r.covered(uint64(p), size, false) {
		return fail(call, cuda.ErrorInvalidValue)
	}
	for _, m := range r.maps {
		for g := max(m.base, uint64(p)); g < min(m.base+m.size, uint64(p)+size); g += Granularity {
			m.access[(g-m.base)/Granularity] = true
		}
	}
	return nil
}
