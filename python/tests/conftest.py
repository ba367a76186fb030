import os
import shutil
import subprocess
import tempfile
import time

import pytest
import torch

from handoff_agent import KVLayout, Layout, MambaLayout, Pools

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="session")
def agent_bin(tmp_path_factory):
    """The handoff-agent binary: $HANDOFF_AGENT_BIN, or built with go."""
    path = os.environ.get("HANDOFF_AGENT_BIN")
    if path:
        return path
    if shutil.which("go") is None:
        pytest.skip("go not found and HANDOFF_AGENT_BIN not set")
    out = str(tmp_path_factory.mktemp("bin") / "handoff-agent")
    subprocess.run(["go", "build", "-o", out, "./cmd/handoff-agent"], cwd=REPO, check=True)
    return out


class AgentProc:
    """A handoff-agent process serving a socket in a private directory."""

    def __init__(self, binary, name, transports, sock=None):
        self.binary, self.name, self.transports = binary, name, transports
        self.tmpdir = None
        if sock is None:
            self.tmpdir = tempfile.mkdtemp(prefix="handoff-agent-test-")  # mode 0700
            sock = os.path.join(self.tmpdir, name + ".sock")
        self.sock = sock
        self.proc = None
        self.start()

    def start(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.log = open(self.sock + ".log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--name", self.name, "--socket", self.sock, "--transports", self.transports],
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 10
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent {self.name} did not start: {open(self.sock + '.log').read()}")
            time.sleep(0.01)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def agents(agent_bin):
    started = []

    def start(name, transports="shm,tcp"):
        a = AgentProc(agent_bin, name, transports)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()
        if a.tmpdir is not None:
            shutil.rmtree(a.tmpdir, ignore_errors=True)


def tiny_layout(**kw) -> Layout:
    """tiny-hybrid's cache shapes ("M*M-M*-": 3 Mamba layers, 2 attention
    layers), with small pools; row 7 is the padding row."""
    lay = Layout(
        model="tiny-hybrid",
        revision="test",
        pattern="M*M-M*-",
        vocab=256,
        kv=KVLayout(layers=2, kv_heads=2, head_dim=16, tokens_per_block=16, dtype="float32", blocks=64),
        mamba=MambaLayout(
            layers=3, heads=4, head_dim=16, d_state=16, n_groups=2, d_conv=4,
            conv_dtype="float32", ssm_dtype="float32", rows=8, reserved=[7],
        ),
    )
    for k, v in kw.items():
        setattr(lay, k, v)
    return lay


def random_pools(layout: Layout, seed: int) -> Pools:
    p = Pools(layout)
    g = torch.Generator().manual_seed(seed)
    p.kv.copy_(torch.randn(p.kv.shape, generator=g))
    for layer in range(layout.mamba.layers):
        p.conv(layer).copy_(torch.randn(p.conv(layer).shape, generator=g))
        p.ssm(layer).copy_(torch.randn(p.ssm(layer).shape, generator=g))
    return p


def _span(n: int, tp: int, r: int) -> tuple[int, int]:
    """Items [lo, hi) of n that shard r of TP tp holds (one, replicated, past n)."""
    if tp <= n:
        return r * n // tp, (r + 1) * n // tp
    lo = r * n // tp
    return lo, lo + 1


def load_shard(shard: Pools, whole: Pools) -> None:
    """Copies into ``shard`` (a TP shard's pools) its part of ``whole`` (the
    same layout at TP 1): kv heads, Mamba heads and groups, by rank."""
    lay, tp, r = shard.layout, shard.layout.tp_size, shard.layout.tp_rank
    h0, h1 = _span(lay.kv.kv_heads, tp, r)
    shard.kv.copy_(whole.kv[:, :, :, h0:h1])
    m = lay.mamba
    a0, a1 = _span(m.heads, tp, r)
    g0, g1 = _span(m.n_groups, tp, r)
    d_inner, gs = m.heads * m.head_dim, m.n_groups * m.d_state
    assert m.conv_layout == "xbc"
    ax = 2 if m.conv_order == "sd" else 1  # the channels' axis
    for layer in range(m.layers):
        w = whole.conv(layer)
        x = w.narrow(ax, a0 * m.head_dim, (a1 - a0) * m.head_dim)
        b = w.narrow(ax, d_inner + g0 * m.d_state, (g1 - g0) * m.d_state)
        c = w.narrow(ax, d_inner + gs + g0 * m.d_state, (g1 - g0) * m.d_state)
        shard.conv(layer).copy_(torch.cat([x, b, c], dim=ax))
        shard.ssm(layer).copy_(whole.ssm(layer)[:, a0:a1])
