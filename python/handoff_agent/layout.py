"""Cache layouts in the terms of handoff's pools, and memfd-backed tensors."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class MambaLayout:
    """The Mamba state pool: ``rows`` rows back to back, each every layer's
    conv state (sections in conv_layout order, each channel d_conv-1
    elements) then its SSM state [heads][head_dim][d_state]. ``reserved``
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
        if self.kv is not None:
            d["kv"] = dataclasses.asdict(self.kv)
        if self.mamba is not None:
            d["mamba"] = dataclasses.asdict(self.mamba)
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


class _Memfd:
    """size bytes of a memfd, mapped shared; the fd is what the agent maps."""

    def __init__(self, name: str, size: int):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
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
        """Conv state of Mamba layer ``layer``: [rows, conv_dim, d_conv-1]."""
        lay, m = self.layout, self.layout.mamba
        off = layer * (lay.conv_bytes() + lay.ssm_bytes())
        t = self.mamba[:, off : off + lay.conv_bytes()].view(_dtype(m.conv_dtype))
        return t.unflatten(1, (lay.conv_dim(), m.d_conv - 1))

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
