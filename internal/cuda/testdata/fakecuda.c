// A fake libcuda.so.1 for the purego loader's tests: the driver entry points
// package cuda resolves, with the real ABIs (versioned names, 64-bit sizes,
// the 64-byte CUipcMemHandle by value) and the rules package cudafake keeps
// (context per thread, base-pointer handles opened only from another
// process, ALREADY_MAPPED, stale handles, pinned host memory for async
// copies). "Device memory" is a memfd, so another process opening a handle
// (through /proc/PID/fd) sees the same bytes; handles have cudafake's layout.
// The VMM calls (cuMemCreate and the calls around it, POSIX fd handles only)
// keep cudafake's rules too: a 2 MiB granularity, memfds named
// fakecuda-vmm-<device uuid> that an export duplicates (so either fake
// imports the other's exports), reservations backed by PROT_NONE host
// ranges that cuMemMap maps the memfd into, no copy before cuMemSetAccess;
// the structs they take are checked field by field, so a caller's layout
// that is off fails with CUDA_ERROR_INVALID_VALUE.
//
// The unsuffixed legacy names are exported with their old 32-bit ABIs and
// fail loudly: a loader that resolves them instead of the _v2 names breaks.
// FAKECUDA_STUB=1 (or -DFORCE_STUB) answers every call with
// CUDA_ERROR_STUB_LIBRARY (34), as the toolkit's stub does;
// -DOMIT_MEMALLOC_V2 builds a library without cuMemAlloc_v2 (a driver too
// old); FAKECUDA_DEVICES sets the device count (0: none).
//
// Build: cc -shared -fPIC -o libcuda.so.1 fakecuda.c
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUevent;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type, id; } CUmemLocation;
typedef struct {
  int type, requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");

enum {
  OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, STUB = 34,
  NO_DEVICE = 100, INVALID_DEVICE = 101, INVALID_CONTEXT = 201, MAP_FAILED_ = 205,
  ALREADY_MAPPED = 208, INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600,
  NOT_SUPPORTED = 801,
};
// cuda.h's VMM enumerators this fake accepts.
enum { PINNED = 1, POSIX_FD = 1, LOCATION_DEVICE = 1, PROT_READWRITE = 3 };

#define MAXA 4096
#define MAXH 1024
#define MAXV 4096
#define GRAN ((size_t)2 << 20)
#define EXPORT __attribute__((visibility("default")))

struct alloc { CUdeviceptr base; size_t size; int dev, fd, imported, live; char *mem;
               unsigned long long ino, bufid; int kpid; };
struct handle { int live, kind, polls, dev; };  // kind 1 stream, 2 event
struct pin { char *p; size_t n; };
// VMM: a handle holds its memfd, a mapping its MAP_SHARED pages, so the
// kernel keeps the memory while either lives. Handle numbers are never
// reused, so a released one stays invalid.
struct vhandle { int live, used, fd, dev, on, types; size_t size; };
struct vrange { int live, dev; CUdeviceptr base; size_t size; char *host; };
struct vmap { int live, dev, on, res; CUdeviceptr base; size_t size; unsigned long long bufid; char *access; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
#ifdef FORCE_STUB
static int stub = 1;
#else
static int stub = -1;
#endif
static int inited, ndev = 1;
static int retained[8];
static CUcontext ctxs[8];
static __thread CUcontext current;
static struct alloc allocs[MAXA];
static struct handle handles[MAXH];
static struct pin pins[MAXA];
static CUdeviceptr next_addr;
static unsigned long long next_buf;
static const char magic[8] = {'F','A','K','E','C','U','D','A'};
static struct vhandle vhandles[MAXV];
static struct vrange vranges[MAXV];
static struct vmap vmaps[MAXV];

static int is_stub(void) {
  if (stub < 0) { const char *s = getenv("FAKECUDA_STUB"); stub = s && *s == '1'; }
  return stub;
}
#define ENTER() do { if (is_stub()) return STUB; pthread_mutex_lock(&mu); \
  if (!inited) { pthread_mutex_unlock(&mu); return NOT_INITIALIZED; } } while (0)
#define LEAVE(r) do { CUresult r_ = (r); pthread_mutex_unlock(&mu); return r_; } while (0)

static int ctxdev(void) {
  for (int i = 0; i < ndev; i++) if (current && ctxs[i] == current) return i;
  return -1;
}
#define ENTERCTX(dv) ENTER(); int dv = ctxdev(); if (dv < 0) LEAVE(INVALID_CONTEXT)

static struct alloc *find(CUdeviceptr p, size_t n) {
  for (int i = 0; i < MAXA; i++) {
    struct alloc *a = &allocs[i];
    if (a->live && p >= a->base && p < a->base + a->size && n <= a->base + a->size - p) return a;
  }
  return NULL;
}
static struct vrange *vrange_of(CUdeviceptr p, size_t n) {
  for (int i = 0; i < MAXV; i++) {
    struct vrange *r = &vranges[i];
    if (r->live && p >= r->base && p - r->base < r->size && n <= r->base + r->size - p) return r;
  }
  return NULL;
}
static struct vmap *vmap_at(CUdeviceptr p) {
  for (int i = 0; i < MAXV; i++) {
    struct vmap *m = &vmaps[i];
    if (m->live && p >= m->base && p - m->base < m->size) return m;
  }
  return NULL;
}
// Every granule of [p, p+n) is mapped and, with access, accessible.
static int covered(CUdeviceptr p, size_t n, int access) {
  for (CUdeviceptr g = p & ~(CUdeviceptr)(GRAN - 1); g < p + n; g += GRAN) {
    struct vmap *m = vmap_at(g);
    if (!m || (access && !m->access[(g - m->base) / GRAN])) return 0;
  }
  return 1;
}
static char *dbytes(CUdeviceptr p, size_t n) {
  if (!n) n = 1;
  struct alloc *a = find(p, n);
  if (a) return a->mem + (p - a->base);
  struct vrange *r = vrange_of(p, n);
  return r && covered(p, n, 1) ? r->host + (p - r->base) : NULL;
}
static char *hbytes(const void *p, size_t n) {
  for (int i = 0; i < MAXA; i++)
    if (pins[i].p && (const char *)p >= pins[i].p && (const char *)p < pins[i].p + pins[i].n &&
        n <= (size_t)(pins[i].p + pins[i].n - (const char *)p)) return (char *)p;
  return NULL;
}
// reserve hands out fake device addresses, 2 MiB aligned (or align, a
// larger power of two), with a guard gap after.
static CUdeviceptr reserve(size_t size, size_t align) {
  if (!next_addr) next_addr = 0x300000000000ull + ((unsigned long long)(getpid() % 4096) << 32);
  if (align > GRAN) next_addr = (next_addr + align - 1) & ~(CUdeviceptr)(align - 1);
  CUdeviceptr b = next_addr;
  next_addr += ((size + GRAN - 1) & ~(GRAN - 1)) + GRAN;
  return b;
}
static struct alloc *slot(void) {
  for (int i = 0; i < MAXA; i++) if (!allocs[i].live) return &allocs[i];
  return NULL;
}
static void release(struct alloc *a) {
  munmap(a->mem, a->size);
  if (a->fd >= 0) close(a->fd);
  a->live = 0;
}
// vunmap puts the reservation's PROT_NONE pages back under m.
static void vunmap(struct vmap *m) {
  struct vrange *r = &vranges[m->res];
  mmap(r->host + (m->base - r->base), m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  free(m->access);
  m->live = 0;
}

EXPORT CUresult cuInit(unsigned int flags) {
  if (is_stub()) return STUB;
  pthread_mutex_lock(&mu);
  const char *n = getenv("FAKECUDA_DEVICES");
  if (n) ndev = atoi(n);
  if (ndev > 8) ndev = 8;
  CUresult r = flags ? INVALID_VALUE : ndev == 0 ? NO_DEVICE : OK;
  if (r == OK) inited = 1;
  LEAVE(r);
}
EXPORT CUresult cuDriverGetVersion(int *v) { if (is_stub()) return STUB; *v = 12060; return OK; }
EXPORT CUresult cuDeviceGetCount(int *n) { ENTER(); *n = ndev; LEAVE(OK); }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ord) {
  ENTER(); if (ord < 0 || ord >= ndev) LEAVE(INVALID_DEVICE); *d = ord; LEAVE(OK);
}
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) {
  ENTER(); if (d < 0 || d >= ndev) LEAVE(INVALID_DEVICE);
  memset(u, 0, sizeof *u); memcpy(u->bytes, "fakecuda", 8);
  u->bytes[8] = (char)d; u->bytes[12] = 0x0d; u->bytes[13] = 0x60;
  LEAVE(OK);
}
// The v1 uuid call exists in real drivers; the loader must not need it.
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { (void)u; (void)d; return NOT_SUPPORTED; }
EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
  ENTER(); if (d < 0 || d >= ndev) LEAVE(INVALID_DEVICE);
  switch (attr) {
  case 41: *v = 1; break;            // unified addressing
  case 124: *v = 0; break;           // dma-buf
  case 33: *v = 0x18 + d; break;     // pci bus
  case 34: case 50: *v = 0; break;
  default: LEAVE(INVALID_VALUE);
  }
  LEAVE(OK);
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  ENTER(); if (d < 0 || d >= ndev) LEAVE(INVALID_DEVICE);
  if (!ctxs[d]) ctxs[d] = malloc(1);  // never freed: a released context's address is not reused
  retained[d]++; *c = ctxs[d]; LEAVE(OK);
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  ENTER(); if (d < 0 || d >= ndev) LEAVE(INVALID_DEVICE);
  if (!retained[d]) LEAVE(INVALID_CONTEXT);
  if (--retained[d]) LEAVE(OK);
  ctxs[d] = NULL;  // the context and its memory go
  for (int i = 0; i < MAXA; i++) if (allocs[i].live && allocs[i].dev == d) release(&allocs[i]);
  for (int i = 0; i < MAXH; i++) if (handles[i].live && handles[i].dev == d) handles[i].live = 0;
  for (int i = 0; i < MAXV; i++)
    if (vmaps[i].live && (vmaps[i].dev == d || vranges[vmaps[i].res].dev == d)) vunmap(&vmaps[i]);
  for (int i = 0; i < MAXV; i++)
    if (vranges[i].live && vranges[i].dev == d) { munmap(vranges[i].host, vranges[i].size); vranges[i].live = 0; }
  for (int i = 0; i < MAXV; i++)
    if (vhandles[i].live && vhandles[i].dev == d) { close(vhandles[i].fd); vhandles[i].live = 0; }
  LEAVE(OK);
}
EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; return NOT_SUPPORTED; }
EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
  ENTER();
  if (c) { int ok = 0; for (int i = 0; i < ndev; i++) ok |= ctxs[i] == c; if (!ok) LEAVE(INVALID_CONTEXT); }
  current = c; LEAVE(OK);
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *c) { ENTER(); *c = current; LEAVE(OK); }

#ifndef OMIT_MEMALLOC_V2
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
  ENTERCTX(dv);
  if (!size) LEAVE(INVALID_VALUE);
  struct alloc *a = slot();
  if (!a) LEAVE(OUT_OF_MEMORY);
  int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) { if (fd >= 0) close(fd); LEAVE(OUT_OF_MEMORY); }
  char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) { close(fd); LEAVE(OUT_OF_MEMORY); }
  struct stat st; fstat(fd, &st);
  *a = (struct alloc){.base = reserve(size, 0), .size = size, .dev = dv, .fd = fd, .mem = m,
                      .ino = st.st_ino, .bufid = ++next_buf, .live = 1};
  *p = a->base;
  LEAVE(OK);
}
#endif
// Legacy ABI: a 32-bit pointer and size. Reaching it is the loader's bug.
EXPORT CUresult cuMemAlloc(unsigned int *p, unsigned int size) {
  (void)p; (void)size;
  fprintf(stderr, "fakecuda: legacy cuMemAlloc called\n");
  return NOT_SUPPORTED;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  ENTERCTX(dv); (void)dv;
  struct alloc *a = find(p, 1);
  if (!a || a->base != p || a->imported) LEAVE(INVALID_VALUE);
  release(a); LEAVE(OK);
}
EXPORT CUresult cuMemFree(unsigned int p) { (void)p; return NOT_SUPPORTED; }
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  ENTERCTX(dv); (void)dv;
  struct alloc *a = find(p, 1);
  struct vmap *m = a ? NULL : vmap_at(p);
  if (!a && !m) LEAVE(NOT_FOUND);
  if (base) *base = a ? a->base : m->base;
  if (size) *size = a ? a->size : m->size;
  LEAVE(OK);
}
EXPORT CUresult cuMemHostAlloc(void **pp, size_t n, unsigned int flags) {
  ENTERCTX(dv); (void)dv;
  if (!n || (flags & ~0xfu)) LEAVE(INVALID_VALUE);
  for (int i = 0; i < MAXA; i++) if (!pins[i].p) {
    char *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) LEAVE(OUT_OF_MEMORY);
    pins[i] = (struct pin){m, n}; *pp = m; LEAVE(OK);
  }
  LEAVE(OUT_OF_MEMORY);
}
EXPORT CUresult cuMemFreeHost(void *p) {
  ENTERCTX(dv); (void)dv;
  for (int i = 0; i < MAXA; i++) if (pins[i].p == p) { munmap(p, pins[i].n); pins[i].p = NULL; LEAVE(OK); }
  LEAVE(INVALID_VALUE);
}
EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
  ENTERCTX(dv); (void)dv;
  struct alloc *a = find(p, 1);
  struct vmap *m = a ? NULL : vmap_at(p);
  if (!a && !m) LEAVE(INVALID_VALUE);
  if (attr == 7) { *(unsigned long long *)data = a ? a->bufid : m->bufid; LEAVE(OK); }
  if (attr == 9) { *(int *)data = a ? a->dev : m->on; LEAVE(OK); }
  LEAVE(INVALID_VALUE);
}

static struct handle *hget(void *h, int kind) {
  uintptr_t i = (uintptr_t)h;
  if (i < 0x1000 || i >= 0x1000 + MAXH) return NULL;
  struct handle *x = &handles[i - 0x1000];
  return x->live && x->kind == kind ? x : NULL;
}
static void *hnew(int kind, int dev) {
  for (int i = 1; i < MAXH; i++) if (!handles[i].live && !handles[i].kind) {
    handles[i] = (struct handle){.live = 1, .kind = kind, .dev = dev};
    return (void *)(uintptr_t)(0x1000 + i);
  }
  return NULL;  // handle numbers are never reused, so a destroyed one stays invalid
}
static CUresult check_stream(CUstream s) { return !s || hget(s, 1) ? OK : INVALID_HANDLE; }

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  ENTERCTX(dv); (void)dv; if (!n) LEAVE(OK);
  char *d = dbytes(dst, n); if (!d) LEAVE(INVALID_VALUE);
  memcpy(d, src, n); LEAVE(OK);
}
EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  ENTERCTX(dv); (void)dv; if (!n) LEAVE(OK);
  char *s = dbytes(src, n); if (!s) LEAVE(INVALID_VALUE);
  memcpy(dst, s, n); LEAVE(OK);
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
  ENTERCTX(dv); (void)dv; if (check_stream(s)) LEAVE(INVALID_HANDLE);
  char *d = dbytes(dst, n), *h = hbytes(src, n); if (!d || !h) LEAVE(INVALID_VALUE);
  memcpy(d, h, n); LEAVE(OK);
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
  ENTERCTX(dv); (void)dv; if (check_stream(s)) LEAVE(INVALID_HANDLE);
  char *d = hbytes(dst, n), *x = dbytes(src, n); if (!d || !x) LEAVE(INVALID_VALUE);
  memcpy(d, x, n); LEAVE(OK);
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  ENTERCTX(dv); (void)dv; if (check_stream(s)) LEAVE(INVALID_HANDLE);
  char *d = dbytes(dst, n), *x = dbytes(src, n); if (!d || !x) LEAVE(INVALID_VALUE);
  memmove(d, x, n); LEAVE(OK);
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
  ENTERCTX(dv); (void)dv;
  struct alloc *a = find(p, 1);
  if (!a || a->base != p || a->imported) LEAVE(INVALID_VALUE);
  memset(h, 0, sizeof *h);
  char *b = h->reserved;
  uint32_t pid = (uint32_t)getpid(), fd = (uint32_t)a->fd;
  uint64_t size = a->size;
  memcpy(b, magic, 8); memcpy(b + 8, &pid, 4); memcpy(b + 12, &fd, 4);
  memcpy(b + 16, &a->ino, 8); memcpy(b + 24, &size, 8); memcpy(b + 32, &a->bufid, 8);
  LEAVE(OK);
}
// By value: the whole 64-byte struct travels in the argument area.
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
  ENTERCTX(dv);
  const char *b = h.reserved;
  if (memcmp(b, magic, 8) || (flags & ~1u)) LEAVE(INVALID_VALUE);
  uint32_t pid, fdn; uint64_t ino, size;
  memcpy(&pid, b + 8, 4); memcpy(&fdn, b + 12, 4); memcpy(&ino, b + 16, 8); memcpy(&size, b + 24, 8);
  if ((pid_t)pid == getpid()) LEAVE(INVALID_CONTEXT);
  for (int i = 0; i < MAXA; i++)
    if (allocs[i].live && allocs[i].imported && allocs[i].kpid == (int)pid && allocs[i].ino == ino)
      LEAVE(ALREADY_MAPPED);
  char path[64]; snprintf(path, sizeof path, "/proc/%u/fd/%u", pid, fdn);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) LEAVE(MAP_FAILED_);
  struct stat st;
  if (fstat(fd, &st) || (uint64_t)st.st_ino != ino || (uint64_t)st.st_size < size) { close(fd); LEAVE(MAP_FAILED_); }
  char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) LEAVE(MAP_FAILED_);
  struct alloc *a = slot();
  if (!a) { munmap(m, size); LEAVE(OUT_OF_MEMORY); }
  *a = (struct alloc){.base = reserve(size, 0), .size = size, .dev = dv, .fd = -1, .mem = m, .ino = ino,
                      .bufid = ++next_buf, .imported = 1, .kpid = (int)pid, .live = 1};
  *p = a->base;
  LEAVE(OK);
}
EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
  (void)p; (void)h; (void)flags; return NOT_SUPPORTED;
}
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  ENTERCTX(dv); (void)dv;
  struct alloc *a = find(p, 1);
  if (!a || a->base != p || !a->imported) LEAVE(INVALID_VALUE);
  release(a); LEAVE(OK);
}

// The memfd name of device d's VMM memory: the importer's device is the
// one whose uuid it names.
static void vmm_name(char *out, size_t n, int d) {
  snprintf(out, n, "fakecuda-vmm-66616b6563756461%02x000000%02x%02x0000", d & 0xff, 0x0d, 0x60);
}
static struct vhandle *vget(CUmemGenericAllocationHandle h) {
  if (h < 0x2000 || h >= 0x2000 + MAXV) return NULL;
  struct vhandle *x = &vhandles[h - 0x2000];
  return x->live ? x : NULL;
}
static CUmemGenericAllocationHandle vnew(struct vhandle v) {
  for (int i = 0; i < MAXV; i++) if (!vhandles[i].used) {
    v.live = v.used = 1; vhandles[i] = v;
    return 0x2000 + (CUmemGenericAllocationHandle)i;
  }
  return 0;
}
static CUresult check_prop(const CUmemAllocationProp *prop) {
  if (!prop || prop->type != PINNED || (prop->requestedHandleTypes & ~POSIX_FD) ||
      prop->location.type != LOCATION_DEVICE || prop->win32HandleMetaData || prop->allocFlags.compressionType)
    return INVALID_VALUE;
  return prop->location.id < 0 || prop->location.id >= ndev ? INVALID_DEVICE : OK;
}
#define GRANULES(n) ((n) && (n) % GRAN == 0)

EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
  ENTER(); CUresult r = check_prop(prop); if (r) LEAVE(r);
  if (option != 0 && option != 1) LEAVE(INVALID_VALUE);  // minimum, recommended
  *g = GRAN; LEAVE(OK);
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
  ENTERCTX(dv); CUresult r = check_prop(prop); if (r) LEAVE(r);
  if (flags || !GRANULES(size)) LEAVE(INVALID_VALUE);
  char name[64]; vmm_name(name, sizeof name, prop->location.id);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) { if (fd >= 0) close(fd); LEAVE(OUT_OF_MEMORY); }
  *h = vnew((struct vhandle){.fd = fd, .dev = dv, .on = prop->location.id, .types = prop->requestedHandleTypes, .size = size});
  if (!*h) { close(fd); LEAVE(OUT_OF_MEMORY); }
  LEAVE(OK);
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  ENTERCTX(dv); (void)dv; struct vhandle *x = vget(h); if (!x) LEAVE(INVALID_VALUE);
  close(x->fd); x->live = 0; LEAVE(OK);  // mappings keep the memory
}
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
  ENTERCTX(dv); (void)dv; struct vhandle *x = vget(h);
  if (!x || !out || type != POSIX_FD || !(x->types & POSIX_FD) || flags) LEAVE(INVALID_VALUE);
  int fd = fcntl(x->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) LEAVE(OUT_OF_MEMORY);
  *(int *)out = fd; LEAVE(OK);
}
// For a POSIX fd, osHandle is the descriptor itself, cast to a pointer.
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *osHandle, int type) {
  ENTERCTX(dv);
  int fd = (int)(intptr_t)osHandle;
  if (type != POSIX_FD || fd < 0) LEAVE(INVALID_VALUE);
  char path[64], name[256]; snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, name, sizeof name - 1);
  if (n < 0) LEAVE(INVALID_VALUE);
  name[n] = 0;
  const char *pre = "/memfd:fakecuda-vmm-";
  struct stat st;
  if (strncmp(name, pre, strlen(pre)) || fstat(fd, &st) || !GRANULES((size_t)st.st_size)) LEAVE(INVALID_VALUE);
  int on = dv;  // on the exporter's device where this process sees it
  for (int i = 0; i < ndev; i++) {
    char want[64]; vmm_name(want, sizeof want, i);
    if (!strncmp(name + strlen("/memfd:"), want, strlen(want))) on = i;
  }
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);  // the caller keeps fd
  if (own < 0) LEAVE(OUT_OF_MEMORY);
  *h = vnew((struct vhandle){.fd = own, .dev = dv, .on = on, .types = POSIX_FD, .size = (size_t)st.st_size});
  if (!*h) { close(own); LEAVE(OUT_OF_MEMORY); }
  LEAVE(OK);
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
  ENTERCTX(dv); (void)addr;  // a hint the driver may ignore, as this fake does
  if (flags || !GRANULES(size) || (align && (align % GRAN || (align & (align - 1))))) LEAVE(INVALID_VALUE);
  for (int i = 0; i < MAXV; i++) if (!vranges[i].live) {
    char *host = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (host == MAP_FAILED) LEAVE(OUT_OF_MEMORY);
    vranges[i] = (struct vrange){.live = 1, .dev = dv, .base = reserve(size, align), .size = size, .host = host};
    *p = vranges[i].base; LEAVE(OK);
  }
  LEAVE(OUT_OF_MEMORY);
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
  ENTERCTX(dv); (void)dv;
  for (int i = 0; i < MAXV; i++) {
    struct vrange *r = &vranges[i];
    if (!r->live || r->base != p || r->size != size) continue;
    for (int j = 0; j < MAXV; j++) if (vmaps[j].live && vmaps[j].res == i) LEAVE(INVALID_VALUE);
    munmap(r->host, r->size); r->live = 0; LEAVE(OK);
  }
  LEAVE(INVALID_VALUE);
}
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  ENTERCTX(dv); struct vhandle *x = vget(h);
  if (!x || offset || flags || !GRANULES(size) || p % GRAN || size > x->size) LEAVE(INVALID_VALUE);
  struct vrange *r = vrange_of(p, size);
  if (!r) LEAVE(INVALID_VALUE);
  struct vmap *m = NULL;
  for (int i = 0; i < MAXV; i++) {
    if (!vmaps[i].live) { if (!m) m = &vmaps[i]; continue; }
    if (p < vmaps[i].base + vmaps[i].size && vmaps[i].base < p + size) LEAVE(INVALID_VALUE);  // overlaps a mapping
  }
  if (!m) LEAVE(OUT_OF_MEMORY);
  char *acc = calloc(size / GRAN, 1);
  if (!acc || mmap(r->host + (p - r->base), size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, x->fd, 0) == MAP_FAILED) {
    free(acc); LEAVE(OUT_OF_MEMORY);
  }
  *m = (struct vmap){.live = 1, .dev = dv, .on = x->on, .res = (int)(r - vranges), .base = p, .size = size,
                     .bufid = ++next_buf, .access = acc};
  LEAVE(OK);
}
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
  ENTERCTX(dv); (void)dv; struct vmap *m = vmap_at(p);
  if (!m || m->base != p || m->size != size) LEAVE(INVALID_VALUE);
  vunmap(m); LEAVE(OK);
}
// Access granted to any device opens a mapping to every context's copies;
// only read-write access is granted (never revoked).
EXPORT CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count) {
  ENTERCTX(dv); (void)dv;
  if (!desc || !count || !GRANULES(size) || p % GRAN) LEAVE(INVALID_VALUE);
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != LOCATION_DEVICE || desc[i].flags != PROT_READWRITE) LEAVE(INVALID_VALUE);
    if (desc[i].location.id < 0 || desc[i].location.id >= ndev) LEAVE(INVALID_DEVICE);
  }
  if (!vrange_of(p, size) || !covered(p, size, 0)) LEAVE(INVALID_VALUE);
  for (CUdeviceptr g = p; g < p + size; g += GRAN) { struct vmap *m = vmap_at(g); m->access[(g - m->base) / GRAN] = 1; }
  LEAVE(OK);
}

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned int flags) {
  ENTERCTX(dv); if (flags & ~1u) LEAVE(INVALID_VALUE);
  *s = hnew(1, dv); LEAVE(*s ? OK : OUT_OF_MEMORY);
}
EXPORT CUresult cuStreamSynchronize(CUstream s) { ENTERCTX(dv); (void)dv; LEAVE(check_stream(s)); }
EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
  ENTERCTX(dv); (void)dv; struct handle *x = hget(s, 1); if (!x) LEAVE(INVALID_HANDLE);
  x->live = 0; LEAVE(OK);
}
EXPORT CUresult cuStreamDestroy(CUstream s) { (void)s; return NOT_SUPPORTED; }
EXPORT CUresult cuEventCreate(CUevent *e, unsigned int flags) {
  ENTERCTX(dv); if (flags & ~7u) LEAVE(INVALID_VALUE);
  *e = hnew(2, dv); LEAVE(*e ? OK : OUT_OF_MEMORY);
}
EXPORT CUresult cuEventRecord(CUevent e, CUstream s) {
  ENTERCTX(dv); (void)dv; struct handle *x = hget(e, 2);
  if (!x || check_stream(s)) LEAVE(INVALID_HANDLE);
  x->polls = 1; LEAVE(OK);  // the first query answers NOT_READY
}
EXPORT CUresult cuEventQuery(CUevent e) {
  ENTERCTX(dv); (void)dv; struct handle *x = hget(e, 2); if (!x) LEAVE(INVALID_HANDLE);
  if (x->polls > 0) { x->polls--; LEAVE(NOT_READY); }
  LEAVE(OK);
}
EXPORT CUresult cuEventDestroy_v2(CUevent e) {
  ENTERCTX(dv); (void)dv; struct handle *x = hget(e, 2); if (!x) LEAVE(INVALID_HANDLE);
  x->live = 0; LEAVE(OK);
}
EXPORT CUresult cuEventDestroy(CUevent e) { (void)e; return NOT_SUPPORTED; }
