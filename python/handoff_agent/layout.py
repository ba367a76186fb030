"""Cache layouts in the terms of handoff's pools, and memfd-backed tensors."""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
from typing import Optional

import torch

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} not supported") from None


def _itemsize(name: str) -> int:
    return torch.empty(0, dtype=_dtype(name)).element_size()


def _local(n: int, tp: int) -> int:
    """Items a shard of a TP-tp group holds (one, replicated, past n)."""
    return n // tp if n >= tp else 1


@dataclasses.dataclass
class KVLayout:
    """The paged KV cache: ``blocks`` blocks back to back, each every
    attention layer's K then V, each [kv_heads][tokens_per_block][head_dim]
    (whole-model kv_heads; a TP shard holds kv_heads / tp)."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    blocks: int
    # Where each layer's K and V lie when the cache is kept per layer (see
    # LayerPools): 2*layers (offset, stride) pairs in bytes, layer l's K
    # then its V; block b's part of a plane at offset + b*stride; or
    # (offset, stride, buffer) triples naming buffers of a registration by
    # buffers. None: blocks back to back, every layer's K then V in each.
    planes: Optional[list[tuple[int, ...]]] = None
    # Element order within a block's K or V: "hnd" (heads, tokens,
    # head_dim: TensorRT-LLM's, vLLM's HND) or "nhd" (tokens, heads,
    # head_dim: vLLM's default, SGLang's). NHD moves only between NHD
    # engines of one TP size (it cannot be cut by heads).
    order: str = "hnd"


@dataclasses.dataclass
class MambaLayout:
    """The Mamba state pool: ``rows`` rows back to back, each every layer's
    conv state (sections in conv_layout order, each channel d_conv-1
    elements; with conv_order "sd" the d_conv-1 positions, each every
    channel) then its SSM state [heads][head_dim][d_state]. ``reserved``
    rows (padding, attention-DP dummy) never travel."""

    layers: int
    heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    conv_dtype: str
    ssm_dtype: str
    rows: int
    reserved: list[int]
    conv_layout: str = "xbc"
    # Per layer kept apart: 2*layers (offset, stride) pairs (or (offset,
    # stride, buffer) triples), layer l's conv state then its SSM state;
    # row r's part at offset + r*stride.
    planes: Optional[list[tuple[int, ...]]] = None
    # Element order within a conv state: "ds" (channels, then the d_conv-1
    # positions: TensorRT-LLM's, vLLM's "DS") or "sd" (positions, then
    # channels: vLLM's default "SD").
    conv_order: str = "ds"


@dataclasses.dataclass
class Layout:
    model: str
    kv: Optional[KVLayout] = None
    mamba: Optional[MambaLayout] = None
    revision: str = ""
    pattern: str = ""
    vocab: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    def wire(self) -> dict:
        d = {
            "model": self.model,
            "revision": self.revision,
            "pattern": self.pattern,
            "vocab": self.vocab,
            "tp": {"rank": self.tp_rank, "size": self.tp_size},
        }
        for name, c in (("kv", self.kv), ("mamba", self.mamba)):
            if c is None:
                continue
            d[name] = dataclasses.asdict(c)
            if c.planes is None:
                del d[name]["planes"]
            else:
                d[name]["planes"] = [_plane(p) for p in c.planes]
        return d

    # Shard shapes and sizes, as the agent computes them.

    def kv_heads_local(self) -> int:
        return _local(self.kv.kv_heads, self.tp_size)

    def block_bytes(self) -> int:
        k = self.kv
        if k is None:
            return 0
        es = _itemsize(k.dtype)
        return 2 * k.layers * self.kv_heads_local() * k.tokens_per_block * k.head_dim * es

    def mamba_dims(self) -> tuple[int, int]:
        """(heads, groups) of the shard."""
        m = self.mamba
        return _local(m.heads, self.tp_size), _local(m.n_groups, self.tp_size)

    def conv_dim(self) -> int:
        h, g = self.mamba_dims()
        return h * self.mamba.head_dim + 2 * g * self.mamba.d_state

    def conv_shape(self) -> tuple[int, int]:
        """One row's conv state of one layer, in the conv order."""
        m = self.mamba
        if m.conv_order == "sd":
            return (m.d_conv - 1, self.conv_dim())
        return (self.conv_dim(), m.d_conv - 1)

    def conv_bytes(self) -> int:
        m = self.mamba
        return self.conv_dim() * (m.d_conv - 1) * _itemsize(m.conv_dtype)

    def ssm_bytes(self) -> int:
        m = self.mamba
        h, _ = self.mamba_dims()
        return h * m.head_dim * m.d_state * _itemsize(m.ssm_dtype)

    def row_bytes(self) -> int:
        if self.mamba is None:
            return 0
        return self.mamba.layers * (self.conv_bytes() + self.ssm_bytes())

    def kv_plane_bytes(self) -> list[int]:
        """Bytes of one block in each KV plane: layer l's K, then its V."""
        n = self.block_bytes() // (2 * self.kv.layers)
        return [n] * (2 * self.kv.layers)

    def mamba_plane_bytes(self) -> list[int]:
        """Bytes of one row in each Mamba plane: layer l's conv, then SSM."""
        return [self.conv_bytes(), self.ssm_bytes()] * self.mamba.layers

    def _planes(self, c, lens: list[int], units: int):
        """(buffer, end) of each of cache c's planes, checked against the
        layout's count."""
        if len(c.planes) != len(lens):
            raise ValueError(f"{len(c.planes)} planes, the layout has {len(lens)}")
        return [(p[2] if len(p) > 2 else 0, p[0] + (units - 1) * p[1] + n) for p, n in zip(c.planes, lens)]

    def buffer_bytes(self) -> dict[int, int]:
        """The least bytes each buffer the planes name must hold, by index
        (planes given as (offset, stride, buffer))."""
        need: dict[int, int] = {}
        if self.kv is not None and self.kv.planes is not None:
            for b, end in self._planes(self.kv, self.kv_plane_bytes(), self.kv.blocks):
                need[b] = max(need.get(b, 0), end)
        if self.mamba is not None and self.mamba.planes is not None:
            for b, end in self._planes(self.mamba, self.mamba_plane_bytes(), self.mamba.rows):
                need[b] = max(need.get(b, 0), end)
        return need

    def kv_bytes(self) -> int:
        """The least memory that holds the KV cache where it is placed."""
        k = self.kv
        if k is None:
            return 0
        if k.planes is None:
            return k.blocks * self.block_bytes()
        return max(end for _, end in self._planes(k, self.kv_plane_bytes(), k.blocks))

    def mamba_bytes(self) -> int:
        """The least memory that holds the Mamba state where it is placed."""
        m = self.mamba
        if m is None:
            return 0
        if m.planes is None:
            return m.rows * self.row_bytes()
        return max(end for _, end in self._planes(m, self.mamba_plane_bytes(), m.rows))


def _plane(p) -> dict:
    """A plane on the wire: (offset, stride) or (offset, stride, buffer)."""
    d = {"offset": int(p[0]), "stride": int(p[1])}
    if len(p) > 2:
        d["buffer"] = int(p[2])
    return d


_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _ipc_handle(h: bytes) -> bytes:
    """The CUDA IPC handle in what ``_share_cuda_`` returns: the 64-byte
    handle itself (torch before 2.5), or a version byte, a type byte and,
    for a cudaMalloc block (type ``c``), the handle (torch 2.5 on)."""
    if len(h) == _IPC_HANDLE_BYTES:
        return h
    if len(h) >= 2 and h[1:2] == b"e":
        raise ValueError(
            "the tensor lies in one of torch's expandable segments, which have no CUDA IPC handle: "
            "allocate the cache pools with expandable_segments:False in PYTORCH_CUDA_ALLOC_CONF"
        )
    if len(h) == 2 + _IPC_HANDLE_BYTES and h[1:2] == b"c":
        return h[2:]
    raise ValueError(f"a shared CUDA handle of {len(h)} bytes in a format this client does not know")


def cuda_memory(t: torch.Tensor) -> dict:
    """How the agent opens a pool tensor that lies on a GPU (``kv_cuda`` or
    ``mamba_cuda`` of a registration): the CUDA IPC handle of the allocation
    the tensor lies in, the tensor's byte offset in that allocation, and
    the device's UUID as nvidia-smi prints it. The tensor must be
    contiguous: the agent maps ``t.nbytes`` bytes from that offset.

    torch's caching allocator hands out pieces of larger allocations, so
    the handle is the allocation's and the offset says where in it the
    storage starts (``_share_cuda_``), plus where in the storage the tensor
    starts. Sharing is for the process's lifetime, as a cache pool's is:
    torch keeps a storage it shared until the process exits, even once the
    tensor is freed, so share the pools once, not per request. Memory of
    torch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True``) has no CUDA IPC handle and is refused."""
    if not t.is_cuda:
        raise ValueError(f"a tensor on {t.device}, not on a GPU: register host memory with Pools")
    if not t.is_contiguous():
        raise ValueError("a pool tensor must be contiguous: the agent maps its bytes as one range")
    shared = t.untyped_storage()._share_cuda_()
    device, handle, storage_offset = shared[0], _ipc_handle(bytes(shared[1])), shared[3]
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return {
        "handle": bytes(handle),
        "offset": int(storage_offset) + t.storage_offset() * t.element_size(),
        "device": uuid if uuid.startswith("GPU-") else "GPU-" + uuid,
    }


@dataclasses.dataclass(frozen=True)
class VMMMemory:
    """A pool or buffer in one allocation of the CUDA virtual memory
    management API (``cuMemCreate``), which no CUDA IPC handle names: what
    an engine's own allocator built on that API hands out. Pass it to
    :meth:`Agent.register_cuda` where a tensor would go.

    ``fd`` is the allocation exported as a POSIX file descriptor
    (``cuMemExportToShareableHandle`` with
    ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``; the allocation must have
    been created with that handle type requested), ``alloc_bytes`` the
    allocation's size as created, ``offset`` where the pool starts in it
    and ``nbytes`` its length; ``device`` the device's UUID ("GPU-…", as
    nvidia-smi prints it). The pool must lie in that one allocation (a
    tensor of torch's expandable segments spans many). Export each
    allocation once and pass pools in it with the same fd: they are mapped
    once and checked not to overlap. The fd stays the engine's (the
    registration passes a copy). The agent's mapping keeps the memory
    while registered: an engine that releases or remaps it ends its
    registration first (closes its connection) and registers again
    after."""

    fd: int
    alloc_bytes: int
    offset: int
    nbytes: int
    device: str

    def __post_init__(self):
        for name in ("fd", "alloc_bytes", "offset", "nbytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"VMM memory with {name} {v!r}, not an int")
        if self.fd < 0:
            raise ValueError(f"VMM memory with fd {self.fd}")
        if self.alloc_bytes <= 0 or self.nbytes <= 0 or self.offset < 0:
            raise ValueError(f"VMM memory of {self.nbytes} bytes at {self.offset} of an allocation of {self.alloc_bytes}")
        if self.offset + self.nbytes > self.alloc_bytes:
            raise ValueError(
                f"{self.nbytes} bytes at offset {self.offset} run past the VMM allocation's {self.alloc_bytes}"
            )

    def wire(self) -> dict:
        uuid = self.device
        return {
            "vmm_bytes": self.alloc_bytes,
            # Names the allocation: the driver's fds do not tell them apart.
            "vmm_id": self.fd + 1,
            "offset": self.offset,
            "device": uuid if uuid.startswith("GPU-") else "GPU-" + uuid,
        }


class _Memfd:
    """size bytes of a memfd, mapped shared; the fd is what the agent maps."""

    def __init__(self, name: str, size: int):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Its size is fixed for every process that maps it (the agents):
            # a page past the end of a shrunk file kills the one touching it.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self):
        # Tensors viewing the map must be gone first (mmap refuses otherwise).
        try:
            self.mm.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Pools:
    """The cache tensors of one engine worker (one TP shard), in memory the
    agent can map: ``kv`` is a tensor [blocks, layers, 2, heads, tokens,
    head_dim] of the KV dtype; ``mamba`` a uint8 tensor [rows, row_bytes],
    with :meth:`conv` and :meth:`ssm` typed views of one layer."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._kv_mem = self._mamba_mem = None
        self.kv = self.mamba = None
        if layout.kv is not None:
            k = layout.kv
            self._kv_mem = _Memfd("handoff-kv", k.blocks * layout.block_bytes())
            raw = torch.frombuffer(self._kv_mem.mm, dtype=torch.uint8)
            self.kv = raw.view(_dtype(k.dtype)).view(
                k.blocks, k.layers, 2, layout.kv_heads_local(), k.tokens_per_block, k.head_dim
            )
        if layout.mamba is not None:
            m = layout.mamba
            self._mamba_mem = _Memfd("handoff-mamba", m.rows * layout.row_bytes())
            raw = torch.frombuffer(self._mamba_mem.mm, dtype=torch.uint8)
            self.mamba = raw.view(m.rows, layout.row_bytes())

    def conv(self, layer: int) -> torch.Tensor:
        """Conv state of Mamba layer ``layer``: [rows, conv_dim, d_conv-1]
        ([rows, d_conv-1, conv_dim] for conv order "sd")."""
        lay, m = self.layout, self.layout.mamba
        off = layer * (lay.conv_bytes() + lay.ssm_bytes())
        t = self.mamba[:, off : off + lay.conv_bytes()].view(_dtype(m.conv_dtype))
        return t.unflatten(1, lay.conv_shape())

    def ssm(self, layer: int) -> torch.Tensor:
        """SSM state of Mamba layer ``layer``: [rows, heads, head_dim, d_state]."""
        lay, m = self.layout, self.layout.mamba
        off = layer * (lay.conv_bytes() + lay.ssm_bytes()) + lay.conv_bytes()
        t = self.mamba[:, off : off + lay.ssm_bytes()].view(_dtype(m.ssm_dtype))
        h, _ = lay.mamba_dims()
        return t.unflatten(1, (h, m.head_dim, m.d_state))

    def fds(self) -> list[tuple[int, int]]:
        """(fd, bytes) of the KV memory then the Mamba memory (-1, 0 when absent)."""
        out = []
        for mem in (self._kv_mem, self._mamba_mem):
            out.append((mem.fd, mem.size) if mem is not None else (-1, 0))
        return out

    def close(self):
        self.kv = self.mamba = None
        for mem in (self._kv_mem, self._mamba_mem):
            if mem is not None:
                mem.close()


class LayerPools:
    """The cache tensors of one engine worker (one TP shard) kept per layer,
    as vLLM and SGLang keep them: :meth:`kv_layer` is attention layer l's
    tensor [2, blocks, heads, tokens, head_dim] (K then V; heads, tokens,
    head_dim within a block: vLLM's HND order), :meth:`conv` and :meth:`ssm`
    Mamba layer l's states [rows, conv_dim, d_conv-1] ([rows, d_conv-1,
    conv_dim] for conv order "sd") and [rows, heads, head_dim, d_state].
    All in one memfd, each tensor page-aligned, or with
    ``separate`` each tensor in a memfd of its own (an allocation each, as
    vLLM allocates them), registered as buffers. ``layout`` is the one given
    with its planes filled in: the engine registers it as it would
    :class:`Pools`."""

    _ALIGN = 4096

    def __init__(self, layout: Layout, separate: bool = False):
        lay = dataclasses.replace(layout)
        self.separate = separate
        sizes = [] if separate else [0]  # by buffer
        spans = {}  # name -> (buffer, offset, bytes)

        def put(name, n):
            if separate:
                spans[name] = (len(sizes), 0, n)
                sizes.append(n)
                return
            at = sizes[0]
            spans[name] = (0, at, n)
            sizes[0] = (at + n + self._ALIGN - 1) // self._ALIGN * self._ALIGN

        def plane(name, off, stride):
            buf, base, _ = spans[name]
            return (base + off, stride, buf) if separate else (base + off, stride)

        if lay.kv is not None:
            k, pb = lay.kv, lay.kv_plane_bytes()[0]
            planes = []
            for layer in range(k.layers):
                put(("kv", layer), 2 * k.blocks * pb)
                planes += [plane(("kv", layer), 0, pb), plane(("kv", layer), k.blocks * pb, pb)]
            lay.kv = dataclasses.replace(k, planes=planes)
        if lay.mamba is not None:
            m, cb, sb = lay.mamba, lay.conv_bytes(), lay.ssm_bytes()
            planes = []
            for layer in range(m.layers):
                put(("conv", layer), m.rows * cb)
                put(("ssm", layer), m.rows * sb)
                planes += [plane(("conv", layer), 0, cb), plane(("ssm", layer), 0, sb)]
            lay.mamba = dataclasses.replace(m, planes=planes)
        self.layout = lay
        self._mems = [_Memfd(f"handoff-layers-{i}", max(n, 1)) for i, n in enumerate(sizes)]
        self._raws = [torch.frombuffer(mem.mm, dtype=torch.uint8) for mem in self._mems]
        self._spans = spans

    def _view(self, name, dtype, shape):
        buf, off, n = self._spans[name]
        return self._raws[buf][off : off + n].view(_dtype(dtype)).view(*shape)

    def kv_layer(self, layer: int) -> torch.Tensor:
        """Attention layer ``layer``: [2, blocks, heads, tokens, head_dim],
        or [2, blocks, tokens, heads, head_dim] for order "nhd"."""
        k = self.layout.kv
        h, n = self.layout.kv_heads_local(), k.tokens_per_block
        inner = (n, h) if k.order == "nhd" else (h, n)
        return self._view(("kv", layer), k.dtype, (2, k.blocks, *inner, k.head_dim))

    def kv_block(self, b: int) -> torch.Tensor:
        """Block ``b`` as :class:`Pools` holds one, [layers, 2, heads,
        tokens, head_dim] (tokens and heads swapped for order "nhd"; a
        copy, gathered from the layers)."""
        return torch.stack([self.kv_layer(layer)[:, b] for layer in range(self.layout.kv.layers)])

    def conv(self, layer: int) -> torch.Tensor:
        """Conv state of Mamba layer ``layer``: [rows, conv_dim, d_conv-1]
        ([rows, d_conv-1, conv_dim] for conv order "sd")."""
        lay, m = self.layout, self.layout.mamba
        return self._view(("conv", layer), m.conv_dtype, (m.rows, *lay.conv_shape()))

    def ssm(self, layer: int) -> torch.Tensor:
        """SSM state of Mamba layer ``layer``: [rows, heads, head_dim, d_state]."""
        lay, m = self.layout, self.layout.mamba
        h, _ = lay.mamba_dims()
        return self._view(("ssm", layer), m.ssm_dtype, (m.rows, h, m.head_dim, m.d_state))

    def fds(self) -> list[tuple[int, int]]:
        """(fd, bytes) for the KV cache then the Mamba state: the one memfd
        for both (-1, 0 for one the layout has not)."""
        if self.separate:
            raise ValueError("separate tensors are registered as buffers: see buffers()")
        mem = self._mems[0]
        return [(mem.fd, mem.size) if c is not None else (-1, 0) for c in (self.layout.kv, self.layout.mamba)]

    def buffers(self) -> list[tuple[int, int]]:
        """(fd, bytes) of each buffer, in the order the planes name them."""
        return [(mem.fd, mem.size) for mem in self._mems]

    def close(self):
        self._raws = []
        for mem in self._mems:
            mem.close()
