"""Registration of pools on a GPU by CUDA IPC handle. torch here has no
CUDA, so a stand-in tensor answers what the helper asks of a CUDA tensor;
the agent is real and gets as far as loading the driver."""

import ctypes
import os
import shutil
import subprocess
from uuid import UUID as UUIDType

import pytest
import torch

from conftest import REPO, random_pools, tiny_layout
from handoff_agent import Agent, AgentError, LayerPools, VMMMemory, cuda_memory

UUID = "5b1a9e2c-0c3d-4f0e-9a55-1c2d3e4f5a6b"


class _Storage:
    def __init__(self, handle, storage_offset):
        self.handle, self.storage_offset = handle, storage_offset

    def _share_cuda_(self):
        # device, handle, size, storage offset, ref counter handle and
        # offset, event handle, event sync required: torch's order.
        return (0, self.handle, 1 << 30, self.storage_offset, b"ref", 0, b"ev", False)


class _CudaTensor:
    """What cuda_memory reads of a CUDA tensor: nbytes elements of
    element_size bytes, storage_offset elements into a storage that lies
    storage_offset bytes into an allocation."""

    is_cuda = True
    device = "cuda:0"

    def __init__(self, nbytes, handle=bytes(range(64)), alloc_offset=4096, elem_offset=0, contiguous=True):
        self.nbytes, self._elem_offset, self._contiguous = nbytes, elem_offset, contiguous
        self._storage = _Storage(handle, alloc_offset)

    def is_contiguous(self):
        return self._contiguous

    def untyped_storage(self):
        return self._storage

    def storage_offset(self):
        return self._elem_offset

    def element_size(self):
        return 2


@pytest.fixture
def gpu0(monkeypatch):
    class Props:
        uuid = UUID

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)


def test_cuda_memory_fields(gpu0):
    m = cuda_memory(_CudaTensor(1 << 20, alloc_offset=8192, elem_offset=100))
    assert m == {"handle": bytes(range(64)), "offset": 8192 + 200, "device": "GPU-" + UUID}


@pytest.mark.parametrize("version", [2, 3])
def test_cuda_memory_versioned_handle(gpu0, version):
    # torch 2.5 on: a version byte, the type ('c': a cudaMalloc block),
    # then the 64-byte handle.
    h = bytes(range(100, 164))
    m = cuda_memory(_CudaTensor(64, handle=bytes([version]) + b"c" + h))
    assert m["handle"] == h


def test_cuda_memory_refusals(gpu0):
    with pytest.raises(ValueError, match="not on a GPU"):
        cuda_memory(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        cuda_memory(_CudaTensor(64, contiguous=False))
    with pytest.raises(ValueError, match="3 bytes"):
        cuda_memory(_CudaTensor(64, handle=b"abc"))
    with pytest.raises(ValueError, match="expandable segments"):
        cuda_memory(_CudaTensor(64, handle=b"\x02e" + bytes(80)))
    with pytest.raises(ValueError, match="66 bytes"):
        cuda_memory(_CudaTensor(64, handle=b"\x02x" + bytes(64)))


def test_register_cuda_sizes(agents, gpu0):
    lay = tiny_layout()
    kv, mamba = lay.kv.blocks * lay.block_bytes(), lay.mamba.rows * lay.row_bytes()
    with Agent.connect(agents("gpu").sock) as a:
        with pytest.raises(ValueError, match="no mamba tensor"):
            a.register_cuda(lay, kv=_CudaTensor(kv))
        with pytest.raises(ValueError, match=f"holds {kv - 2} bytes, the layout {kv}"):
            a.register_cuda(lay, kv=_CudaTensor(kv - 2), mamba=_CudaTensor(mamba))


def test_register_cuda_reaches_the_driver(agents, gpu0, monkeypatch, tmp_path):
    # The agent loads the driver the first time an engine names device
    # memory: here a library that is not there, so the refusal names it,
    # after the agent took the request's fields (a handle of the wrong
    # size is refused before).
    missing = str(tmp_path / "libcuda-missing.so.1")
    monkeypatch.setenv("HANDOFF_LIBCUDA", missing)
    lay = tiny_layout()
    kv, mamba = lay.kv.blocks * lay.block_bytes(), lay.mamba.rows * lay.row_bytes()
    with Agent.connect(agents("gpu").sock) as a:
        with pytest.raises(AgentError) as e:
            a.register_cuda(lay, kv=_CudaTensor(kv), mamba=_CudaTensor(mamba, alloc_offset=kv + 4096))
        assert "CUDA driver" in str(e.value) and missing in str(e.value), e.value
        # The registration failed whole: the engine may register again,
        # and the agent checks what it is given: two pools in one
        # allocation (one handle) that overlap are refused by name.
        with pytest.raises(AgentError) as e:
            a.register_cuda(lay, kv=_CudaTensor(kv), mamba=_CudaTensor(mamba))
        assert e.value.code == "invalid_layout" and "overlap" in str(e.value), e.value


# The same through a driver: the repository's fake libcuda
# (internal/cuda/testdata/fakecuda.c, the real ABIs, "device memory" a
# memfd that another process opens by handle through /proc), loaded by the
# engine here with ctypes and by the agent with purego ($HANDOFF_LIBCUDA).

FAKECUDA_C = os.path.join(REPO, "internal", "cuda", "testdata", "fakecuda.c")


@pytest.fixture(scope="session")
def fakecuda(tmp_path_factory):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    out = str(tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", out, FAKECUDA_C, "-lpthread"], check=True)
    return out


class FakeGPU:
    """Device memory of this process through the fake driver: one
    allocation, as torch's caching allocator hands out pieces of one."""

    def __init__(self, lib_path: str, size: int):
        self._open(lib_path)
        lib = self.lib
        self.base = ctypes.c_ulonglong()
        self._ok(lib.cuMemAlloc_v2(ctypes.byref(self.base), ctypes.c_size_t(size)))
        handle = (ctypes.c_char * 64)()
        self._ok(lib.cuIpcGetMemHandle(handle, self.base))
        self.handle = bytes(handle)

    def _open(self, lib_path: str) -> ctypes.c_int:
        """Loads the driver, makes device 0's primary context current and
        returns the device."""
        self.lib = lib = ctypes.CDLL(lib_path)
        self._ok(lib.cuInit(0))
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._ok(lib.cuDeviceGet(ctypes.byref(dev), 0))
        self._ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        self._ok(lib.cuCtxSetCurrent(ctx))
        uuid = (ctypes.c_char * 16)()
        self._ok(lib.cuDeviceGetUuid_v2(uuid, dev))
        self.uuid = str(UUIDType(bytes=bytes(uuid)))
        return dev

    @staticmethod
    def _ok(r):
        assert r == 0, f"fake CUDA driver: error {r}"

    def write(self, off: int, data: bytes):
        self._ok(self.lib.cuMemcpyHtoD_v2(ctypes.c_ulonglong(self.base.value + off), data, ctypes.c_size_t(len(data))))

    def read(self, off: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self._ok(self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_ulonglong(self.base.value + off), ctypes.c_size_t(n)))
        return buf.raw

    def tensor(self, off: int, nbytes: int):
        """A stand-in CUDA tensor of nbytes at off, shared as torch 2.5 on
        shares it (version, type 'c', the handle)."""
        return _CudaTensor(nbytes, handle=b"\x02c" + self.handle, alloc_offset=off)


@pytest.mark.parametrize("direction", ["device to host", "host to device"])
def test_device_pools_through_the_fake_driver(agents, fakecuda, monkeypatch, direction):
    lay = tiny_layout()
    bb, rb = lay.block_bytes(), lay.row_bytes()
    kv_n, m_n = lay.kv.blocks * bb, lay.mamba.rows * rb
    kv_off, m_off = 4096, 4096 + kv_n + 512  # two tensors in one allocation
    monkeypatch.setenv("HANDOFF_LIBCUDA", fakecuda)
    gpu = FakeGPU(fakecuda, m_off + m_n)

    class Props:
        uuid = gpu.uuid

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    g = torch.Generator().manual_seed(7)
    gpu.write(kv_off, torch.randint(0, 256, (kv_n,), dtype=torch.uint8, generator=g).numpy().tobytes())
    gpu.write(m_off, torch.randint(0, 256, (m_n,), dtype=torch.uint8, generator=g).numpy().tobytes())

    da, ha = agents("gpu", "tcp"), agents("host", "tcp")
    with Agent.connect(da.sock) as dev, Agent.connect(ha.sock) as host:
        fp = dev.register_cuda(lay, kv=gpu.tensor(kv_off, kv_n), mamba=gpu.tensor(m_off, m_n))
        pools = random_pools(lay, 8)
        assert host.register(pools) == fp
        if direction == "device to host":
            before = gpu.read(0, m_off + m_n)
            gr = host.grant(request_id=5, blocks=[9, 3, 20], row=1, deadline=5)
            ev = dev.wait_send(dev.send(gr.ticket, blocks=[0, 1, 2], row=4), timeout=10)
            assert ev.ok, ev
            assert host.wait_grant(gr, timeout=10).ok
            for s, d in [(0, 9), (1, 3), (2, 20)]:
                assert pools.kv[d].contiguous().view(torch.uint8).numpy().tobytes() == gpu.read(kv_off + s * bb, bb)
            assert pools.mamba[1].numpy().tobytes() == gpu.read(m_off + 4 * rb, rb)
            assert gpu.read(0, m_off + m_n) == before, "the sender's device memory changed"
            # The reserved row is refused by name, at the request.
            gr = host.grant(request_id=6, blocks=[5], row=2, deadline=5)
            with pytest.raises(AgentError) as e:
                dev.send(gr.ticket, blocks=[5], row=7)
            assert e.value.code == "reserved", e.value
        else:
            before = bytearray(gpu.read(0, m_off + m_n))
            gr = dev.grant(request_id=5, blocks=[9, 3, 20], row=1, deadline=5)
            ev = host.wait_send(host.send(gr.ticket, blocks=[0, 1, 2], row=4), timeout=10)
            assert ev.ok, ev
            assert dev.wait_grant(gr, timeout=10).ok
            for s, d in [(0, 9), (1, 3), (2, 20)]:
                assert gpu.read(kv_off + d * bb, bb) == pools.kv[s].contiguous().view(torch.uint8).numpy().tobytes()
            assert gpu.read(m_off + rb, rb) == pools.mamba[4].numpy().tobytes()
            # Nothing outside the granted blocks and row moved.
            want = before
            for s, d in [(0, 9), (1, 3), (2, 20)]:
                want[kv_off + d * bb : kv_off + (d + 1) * bb] = pools.kv[s].contiguous().view(torch.uint8).numpy().tobytes()
            want[m_off + rb : m_off + 2 * rb] = pools.mamba[4].numpy().tobytes()
            assert gpu.read(0, m_off + m_n) == bytes(want)


def test_device_buffers_through_the_fake_driver(agents, fakecuda, monkeypatch):
    """Per-layer caches on a GPU, each tensor its own buffer (here pieces of
    one allocation, as torch's caching allocator hands them out), named by
    the planes: blocks and a row sent from a block-major host engine land
    in every layer's tensor."""
    shape = LayerPools(tiny_layout(), separate=True)
    lay, sizes = shape.layout, [n for _, n in shape.buffers()]
    shape.close()
    offs, at = [], 4096
    for n in sizes:
        offs.append(at)
        at += n + 512
    monkeypatch.setenv("HANDOFF_LIBCUDA", fakecuda)
    gpu = FakeGPU(fakecuda, at)

    class Props:
        uuid = gpu.uuid

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    da, ha = agents("gpu", "tcp"), agents("host", "tcp")
    with Agent.connect(da.sock) as dev, Agent.connect(ha.sock) as host:
        with pytest.raises(ValueError, match="buffer 7 holds 0 bytes"):  # checked before anything is sent
            dev.register_cuda(lay, buffers=[gpu.tensor(o, n) for o, n in zip(offs, sizes)][:-1])
        fp = dev.register_cuda(lay, buffers=[gpu.tensor(o, n) for o, n in zip(offs, sizes)])
        pools = random_pools(tiny_layout(), 9)
        assert host.register(pools) == fp
        gr = dev.grant(request_id=7, blocks=[9, 3], row=1, deadline=5)
        ev = host.wait_send(host.send(gr.ticket, blocks=[0, 1], row=4), timeout=10)
        assert ev.ok, ev
        assert dev.wait_grant(gr, timeout=10).ok
        pb = lay.kv_plane_bytes()[0]
        for s, d in [(0, 9), (1, 3)]:
            for layer in range(lay.kv.layers):
                for kv in range(2):
                    off, stride, buf = lay.kv.planes[2 * layer + kv]
                    want = pools.kv[s, layer, kv].contiguous().view(torch.uint8).numpy().tobytes()
                    assert gpu.read(offs[buf] + off + d * stride, pb) == want
        for layer in range(lay.mamba.layers):
            for part, t in ((0, pools.conv(layer)), (1, pools.ssm(layer))):
                off, stride, buf = lay.mamba.planes[2 * layer + part]
                want = t[4].contiguous().view(torch.uint8).numpy().tobytes()
                assert gpu.read(offs[buf] + off + 1 * stride, len(want)) == want


class _AllocProp(ctypes.Structure):
    # CUmemAllocationProp: type, requestedHandleTypes, location (type, id),
    # win32HandleMetaData, allocFlags.
    _fields_ = [
        ("type", ctypes.c_int),
        ("handle_types", ctypes.c_int),
        ("loc_type", ctypes.c_int),
        ("loc_id", ctypes.c_int),
        ("win32", ctypes.c_void_p),
        ("flags", ctypes.c_ubyte * 8),
    ]


class _AccessDesc(ctypes.Structure):
    # CUmemAccessDesc: location (type, id), flags.
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class FakeVMM(FakeGPU):
    """A VMM allocation of this process through the fake driver, as an
    allocator built on cuMemCreate makes one (pinned, on device 0, a POSIX
    fd its handle type), mapped here to fill and read it, and exported as
    the fd an engine passes its agent."""

    def __init__(self, lib_path: str, size: int):
        dev = self._open(lib_path)
        lib = self.lib
        prop = _AllocProp(type=1, handle_types=1, loc_type=1, loc_id=dev.value)
        gran = ctypes.c_size_t()
        self._ok(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0))
        self.size = -(-size // gran.value) * gran.value
        h = ctypes.c_ulonglong()
        self._ok(lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(self.size), ctypes.byref(prop), ctypes.c_ulonglong(0)))
        fd = ctypes.c_int(-1)
        self._ok(lib.cuMemExportToShareableHandle(ctypes.byref(fd), h, 1, ctypes.c_ulonglong(0)))
        self.fd = fd.value
        self.base = ctypes.c_ulonglong()
        self._ok(
            lib.cuMemAddressReserve(
                ctypes.byref(self.base), ctypes.c_size_t(self.size), ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)
            )
        )
        self._ok(lib.cuMemMap(self.base, ctypes.c_size_t(self.size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)))
        acc = _AccessDesc(loc_type=1, loc_id=dev.value, flags=3)
        self._ok(lib.cuMemSetAccess(self.base, ctypes.c_size_t(self.size), ctypes.byref(acc), ctypes.c_size_t(1)))
        self._ok(lib.cuMemRelease(h))  # the mapping keeps the memory

    def close(self):
        self._ok(self.lib.cuMemUnmap(self.base, ctypes.c_size_t(self.size)))
        self._ok(self.lib.cuMemAddressFree(self.base, ctypes.c_size_t(self.size)))
        os.close(self.fd)

    def memory(self, off: int, nbytes: int) -> VMMMemory:
        return VMMMemory(fd=self.fd, alloc_bytes=self.size, offset=off, nbytes=nbytes, device=self.uuid)


def test_vmm_memory_checked():
    with pytest.raises(ValueError, match="run past"):
        VMMMemory(fd=3, alloc_bytes=4096, offset=4000, nbytes=200, device=UUID)
    with pytest.raises(ValueError, match="fd -1"):
        VMMMemory(fd=-1, alloc_bytes=4096, offset=0, nbytes=200, device=UUID)
    m = VMMMemory(fd=3, alloc_bytes=4096, offset=64, nbytes=200, device=UUID)
    assert m.wire() == {"vmm_bytes": 4096, "vmm_id": 4, "offset": 64, "device": "GPU-" + UUID}
    with pytest.raises(ValueError, match="not an int"):
        VMMMemory(fd=3, alloc_bytes=4096.0, offset=0, nbytes=200, device=UUID)


@pytest.mark.parametrize("direction", ["device to host", "host to device"])
def test_vmm_pools_through_the_fake_driver(agents, fakecuda, monkeypatch, direction):
    """Pools in one VMM allocation, registered by the fd the engine
    exported (no CUDA IPC handle names such memory): blocks and a row land
    byte-exact both ways against a host engine over tcp, nothing around
    them moves, and the agent keeps no descriptor of the allocation."""
    lay = tiny_layout()
    bb, rb = lay.block_bytes(), lay.row_bytes()
    kv_n, m_n = lay.kv.blocks * bb, lay.mamba.rows * rb
    kv_off, m_off = 4096, 4096 + kv_n + 512
    monkeypatch.setenv("HANDOFF_LIBCUDA", fakecuda)
    gpu = FakeVMM(fakecuda, m_off + m_n)
    g = torch.Generator().manual_seed(11)
    gpu.write(kv_off, torch.randint(0, 256, (kv_n,), dtype=torch.uint8, generator=g).numpy().tobytes())
    gpu.write(m_off, torch.randint(0, 256, (m_n,), dtype=torch.uint8, generator=g).numpy().tobytes())

    da, ha = agents("gpu", "tcp"), agents("host", "tcp")
    try:
        with Agent.connect(da.sock) as dev, Agent.connect(ha.sock) as host:
            fp = dev.register_cuda(lay, kv=gpu.memory(kv_off, kv_n), mamba=gpu.memory(m_off, m_n))
            assert _fds_of(da.proc.pid, gpu.fd) == 0, "the agent keeps the mapping, not the descriptors"
            pools = random_pools(lay, 8)
            assert host.register(pools) == fp
            before = bytearray(gpu.read(0, gpu.size))
            if direction == "device to host":
                gr = host.grant(request_id=5, blocks=[9, 3, 20], row=1, deadline=5)
                ev = dev.wait_send(dev.send(gr.ticket, blocks=[0, 1, 2], row=4), timeout=10)
                assert ev.ok, ev
                assert host.wait_grant(gr, timeout=10).ok
                for s, d in [(0, 9), (1, 3), (2, 20)]:
                    assert pools.kv[d].contiguous().view(torch.uint8).numpy().tobytes() == gpu.read(kv_off + s * bb, bb)
                assert pools.mamba[1].numpy().tobytes() == gpu.read(m_off + 4 * rb, rb)
                assert gpu.read(0, gpu.size) == bytes(before), "the sender's device memory changed"
            else:
                gr = dev.grant(request_id=5, blocks=[9, 3, 20], row=1, deadline=5)
                ev = host.wait_send(host.send(gr.ticket, blocks=[0, 1, 2], row=4), timeout=10)
                assert ev.ok, ev
                assert dev.wait_grant(gr, timeout=10).ok
                for s, d in [(0, 9), (1, 3), (2, 20)]:
                    before[kv_off + d * bb : kv_off + (d + 1) * bb] = pools.kv[s].contiguous().view(torch.uint8).numpy().tobytes()
                before[m_off + rb : m_off + 2 * rb] = pools.mamba[4].numpy().tobytes()
                assert gpu.read(0, gpu.size) == bytes(before), "only the granted blocks and row changed, to the sent bytes"
    finally:
        gpu.close()


def _fds_of(pid: int, fd: int) -> int:
    """How many descriptors process pid holds of the file fd is."""
    want = os.fstat(fd)
    n = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            n += 1
    return n
