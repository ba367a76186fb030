"""Registration of pools on a GPU by CUDA IPC handle. torch here has no
CUDA, so a stand-in tensor answers what the helper asks of a CUDA tensor;
the agent is real and gets as far as loading the driver."""

import pytest
import torch

from conftest import tiny_layout
from handoff_agent import Agent, AgentError, cuda_memory

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


def test_cuda_memory_refusals(gpu0):
    with pytest.raises(ValueError, match="not on a GPU"):
        cuda_memory(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        cuda_memory(_CudaTensor(64, contiguous=False))
    with pytest.raises(ValueError, match="3 bytes"):
        cuda_memory(_CudaTensor(64, handle=b"abc"))


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
