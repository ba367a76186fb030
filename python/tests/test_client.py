import dataclasses
import os
import queue
import re
import signal
import threading
import time

import pytest
import torch

from conftest import load_shard, random_pools, tiny_layout
from handoff_agent import Agent, AgentClosed, AgentError, LayerPools, Pools


def engine(agent_proc, seed, layout=None):
    a = Agent.connect(agent_proc.sock)
    p = random_pools(layout or tiny_layout(), seed)
    a.register(p)
    return a, p


@pytest.mark.parametrize("transports", ["shm", "tcp"])
def test_send_lands_at_named_blocks(agents, transports):
    pa, pb = agents("pre", transports), agents("dec", transports)
    a, src = engine(pa, 1)
    b, dst = engine(pb, 2)
    assert a.fingerprint == b.fingerprint and re.fullmatch(r"[0-9a-f]{16}", a.fingerprint)
    before = dst.kv.clone()
    g = b.grant(request_id=41, blocks=[9, 3, 20], row=1, deadline=5)
    s = a.send(g.ticket, blocks=[0, 1, 2], row=4)
    ev = a.wait_send(s, timeout=10)
    assert ev.ok, ev
    gev = b.wait_grant(g, timeout=10)
    assert gev.ok and gev.request_id == 41, gev
    assert gev.bytes == 3 * tiny_layout().block_bytes() + tiny_layout().row_bytes()
    for s_blk, d_blk in [(0, 9), (1, 3), (2, 20)]:
        assert torch.equal(src.kv[s_blk], dst.kv[d_blk])
    assert torch.equal(src.mamba[4], dst.mamba[1])
    for layer in range(3):
        assert torch.equal(src.conv(layer)[4], dst.conv(layer)[1])
        assert torch.equal(src.ssm(layer)[4], dst.ssm(layer)[1])
    others = [i for i in range(64) if i not in (9, 3, 20)]
    assert torch.equal(before[others], dst.kv[others])


def test_layer_by_layer(agents):
    pa, pb = agents("pre"), agents("dec")
    a, src = engine(pa, 3)
    b, dst = engine(pb, 4)
    g = b.grant(42, blocks=[5, 6], row=0)
    s = a.open_send(g.ticket, blocks=[10, 11], row=2)
    # The layers in the model's order, as a forward pass finishes them.
    for kind, layer in [("mamba", 0), ("kv", 0), ("mamba", 1), ("mamba", 2), ("kv", 1)]:
        s.layer(kind, layer)
    s.commit()
    assert a.wait_send(s, timeout=10).ok
    assert b.wait_grant(g, timeout=10).ok
    assert torch.equal(src.kv[10], dst.kv[5]) and torch.equal(src.kv[11], dst.kv[6])
    assert torch.equal(src.mamba[2], dst.mamba[0])


def test_layer_then_rest(agents):
    """commit sends what no layer sent."""
    pa, pb = agents("pre"), agents("dec")
    a, src = engine(pa, 5)
    b, dst = engine(pb, 6)
    g = b.grant(43, blocks=[1], row=3)
    s = a.open_send(g.ticket, blocks=[2], row=5)
    s.kv_layer(1)
    s.commit()
    assert a.wait_send(s, timeout=10).ok
    assert b.wait_grant(g, timeout=10).ok
    assert torch.equal(src.kv[2], dst.kv[1]) and torch.equal(src.mamba[5], dst.mamba[3])


def test_reserved_row_refused(agents):
    a, _ = engine(agents("dec"), 7)
    with pytest.raises(AgentError) as e:
        a.grant(44, blocks=[1], row=7)
    assert e.value.code == "reserved"


@pytest.mark.parametrize("transports", ["shm", "tcp"])
def test_send_after_revoke_lands_nothing(agents, transports):
    pa, pb = agents("pre", transports), agents("dec", transports)
    a, src = engine(pa, 8)
    b, dst = engine(pb, 9)
    g = b.grant(45, blocks=[4, 8], row=2)
    b.revoke(g)
    canary_kv, canary_row = dst.kv.clone(), dst.mamba.clone()
    s = a.send(g.ticket, blocks=[0, 1], row=0)
    ev = a.wait_send(s, timeout=10)
    assert not ev.ok and ev.code == "revoked", ev
    assert b.wait_grant(g, timeout=10).code == "revoked"
    assert torch.equal(canary_kv, dst.kv) and torch.equal(canary_row, dst.mamba)


def test_layout_mismatch_refused_by_name(agents):
    a, _ = engine(agents("pre"), 10)
    other = tiny_layout()
    other.mamba.d_state = 32
    b, _ = engine(agents("odd-one"), 11, other)
    g = b.grant(46, blocks=[1], row=0)
    with pytest.raises(AgentError) as e:
        a.send(g.ticket, blocks=[1], row=0)
    assert e.value.code == "layout_mismatch" and '"odd-one"' in str(e.value)


def test_deadline(agents):
    b, _ = engine(agents("dec"), 12)
    g = b.grant(47, blocks=[1], deadline=0.05)
    ev = b.wait_grant(g, timeout=10)
    assert ev.code == "deadline", ev


def test_agent_restart_under_live_engine(agents):
    pa, pb = agents("pre"), agents("dec")
    a, src = engine(pa, 13)
    b, dst = engine(pb, 14)
    pb.kill()
    with pytest.raises(AgentClosed):
        b.next_event(timeout=5)
    with pytest.raises(AgentClosed):
        b.grant(48, blocks=[1])
    assert b.close() is False  # the agent died first: the release is not confirmed
    pb.start()
    b = Agent.connect(pb.sock)
    b.register(dst)  # the same tensors, registered again
    g = b.grant(48, blocks=[1], row=1)
    s = a.send(g.ticket, blocks=[3], row=3)
    assert a.wait_send(s, timeout=10).ok and b.wait_grant(g, timeout=10).ok
    assert torch.equal(src.kv[3], dst.kv[1]) and torch.equal(src.mamba[3], dst.mamba[1])


def test_engine_restart_revokes_old_grants(agents):
    pa, pb = agents("pre"), agents("dec")
    a, src = engine(pa, 15)
    b, dst = engine(pb, 16)
    g = b.grant(49, blocks=[2], row=2)
    b.close()  # the engine "exits"; its tensors live on in this test
    canary = dst.kv.clone()
    s = a.send(g.ticket, blocks=[0], row=0)
    ev = a.wait_send(s, timeout=10)
    assert not ev.ok, ev
    assert torch.equal(canary, dst.kv)
    b = Agent.connect(pb.sock)
    b.register(dst)
    g2 = b.grant(49, blocks=[2], row=2)
    s = a.send(g2.ticket, blocks=[0], row=0)
    assert a.wait_send(s, timeout=10).ok
    assert torch.equal(src.kv[0], dst.kv[2])


def test_register_twice_refused(agents):
    a, p = engine(agents("dec"), 17)
    with pytest.raises(AgentError) as e:
        a.register(p)
    assert e.value.code == "registered"


def test_peers_without_nats(agents):
    # An agent started without --nats-url joins no registry: no peers.
    a, _ = engine(agents("dec"), 18)
    assert a.peers() == []


def send_from_tp2(agents, whole, ticket, layers, transports="shm,tcp", make=tiny_layout):
    """Two TP-2 engines, each with its own agent, load their shards of
    ``whole`` and write its blocks 0, 1 and row 4 into ``ticket``, whole or
    layer by layer; returns them once both sends are done."""
    senders = []
    for r in range(2):
        p = Pools(make(tp_rank=r, tp_size=2))
        load_shard(p, whole)
        a = Agent.connect(agents(f"pre-{r}", transports).sock)
        a.register(p)
        senders.append(a)
    sends = []
    for a in senders:
        if layers:
            s = a.open_send(ticket, blocks=[0, 1], row=4)
            for kind, layer in [("mamba", 0), ("kv", 0), ("mamba", 1), ("mamba", 2), ("kv", 1)]:
                s.layer(kind, layer)
            s.commit()
        else:
            s = a.send(ticket, blocks=[0, 1], row=4)
        sends.append((a, s))
    for a, s in sends:
        assert a.wait_send(s, timeout=10).ok
    return senders


@pytest.mark.parametrize("layers", [False, True])
def test_tp2_to_tp1(agents, layers):
    """Two TP-2 engines, each with its own agent, write one request into a
    TP-1 engine's grant; the agents reshard."""
    whole = random_pools(tiny_layout(), 20)
    b, dst = engine(agents("dec"), 21)
    g = b.grant(50, blocks=[9, 3], row=1, from_tp=2)
    send_from_tp2(agents, whole, g.ticket, layers)
    assert b.wait_grant(g, timeout=10).ok
    assert torch.equal(whole.kv[0], dst.kv[9]) and torch.equal(whole.kv[1], dst.kv[3])
    assert torch.equal(whole.mamba[4], dst.mamba[1])


@pytest.mark.parametrize("layers", [False, True])
def test_tp2_to_tp1_conv_positions_first(agents, layers):
    """As test_tp2_to_tp1, with each conv state kept position by position
    ([rows, d_conv-1, conv_dim]: vLLM's default "SD" order): each shard's
    channels of every position land in the whole model's places."""

    def sd(**kw):
        lay = tiny_layout(**kw)
        lay.mamba = dataclasses.replace(lay.mamba, conv_order="sd")
        return lay

    whole = random_pools(sd(), 24)
    assert whole.conv(0).shape[1:] == (3, sd().conv_dim())
    b = Agent.connect(agents("dec").sock)
    dst = random_pools(sd(), 25)
    b.register(dst)
    g = b.grant(52, blocks=[9, 3], row=1, from_tp=2)
    send_from_tp2(agents, whole, g.ticket, layers, make=sd)
    assert b.wait_grant(g, timeout=10).ok
    for layer in range(3):
        assert torch.equal(whole.conv(layer)[4], dst.conv(layer)[1])
        assert torch.equal(whole.ssm(layer)[4], dst.ssm(layer)[1])
    assert torch.equal(whole.kv[0], dst.kv[9]) and torch.equal(whole.kv[1], dst.kv[3])


def test_tp_mismatch_refused(agents):
    a, _ = engine(agents("pre"), 22)
    b, _ = engine(agents("dec"), 23)
    g = b.grant(51, blocks=[1], from_tp=2)
    with pytest.raises(AgentError) as e:
        a.send(g.ticket, blocks=[1])
    assert e.value.code == "layout_mismatch" and "TP-2" in str(e.value)


def test_send_wait(agents):
    a, src = engine(agents("pre"), 30)
    b, dst = engine(agents("dec"), 31)
    g = b.grant(60, blocks=[12], row=2)
    ev = a.send_wait(g.ticket, blocks=[1], row=3)
    assert ev.ok and ev.bytes == tiny_layout().block_bytes() + tiny_layout().row_bytes()
    assert torch.equal(src.kv[1], dst.kv[12]) and torch.equal(src.mamba[3], dst.mamba[2])
    g = b.grant(61, blocks=[13])
    b.revoke(g)
    with pytest.raises(AgentError) as e:
        a.send_wait(g.ticket, blocks=[1])
    assert e.value.code == "revoked"


def test_send_wait_timeout_drops_the_late_reply(agents):
    a, src = engine(agents("pre"), 32)
    b, dst = engine(agents("dec"), 33)
    g = b.grant(62, blocks=[14], row=2)
    with pytest.raises(TimeoutError):
        a.send_wait(g.ticket, blocks=[1], row=3, timeout=1e-9)
    ev = b.wait_grant(g, timeout=10)
    assert ev.ok and torch.equal(src.kv[1], dst.kv[14])
    # The late reply arrives (within milliseconds of the commit) and is
    # dropped as calls read past it: none is kept for no one. The call is
    # forgotten once its reply came, so the loop ends only after that.
    assert a._abandoned
    end = time.monotonic() + 10
    while a._abandoned and time.monotonic() < end:
        a.peers()
        assert not a._replies
    assert not a._abandoned, "the late reply never came"
    assert not a._replies


def test_pools_memory_cannot_shrink():
    # An agent mapping it would die (SIGBUS) at a page past a shrunk end.
    p = random_pools(tiny_layout(), 34)
    with pytest.raises(PermissionError):
        os.ftruncate(p._kv_mem.fd, 0)


def random_layer_pools(layout, seed, separate=False):
    p = LayerPools(layout, separate=separate)
    g = torch.Generator().manual_seed(seed)
    for layer in range(layout.kv.layers):
        p.kv_layer(layer).copy_(torch.randn(p.kv_layer(layer).shape, generator=g))
    for layer in range(layout.mamba.layers):
        p.conv(layer).copy_(torch.randn(p.conv(layer).shape, generator=g))
        p.ssm(layer).copy_(torch.randn(p.ssm(layer).shape, generator=g))
    return p


def same_row(a, ra, b, rb, layers):
    return all(
        torch.equal(a.conv(layer)[ra], b.conv(layer)[rb]) and torch.equal(a.ssm(layer)[ra], b.ssm(layer)[rb])
        for layer in range(layers)
    )


@pytest.mark.parametrize("transports", ["shm", "tcp"])
@pytest.mark.parametrize("layers", [False, True])
@pytest.mark.parametrize("separate", [False, True])
def test_per_layer_engine(agents, transports, layers, separate):
    """An engine that keeps its caches per layer (vLLM's shapes, LayerPools:
    in one memfd, or each tensor in its own, registered as buffers)
    receives from two TP-2 block-major engines, whole or layer by layer,
    and sends back to a block-major engine; nothing outside the named
    blocks and row changes."""
    lay = tiny_layout()
    whole = random_pools(lay, 30)
    dst = random_layer_pools(lay, 31, separate)
    assert len(dst.buffers()) == (2 * 3 + 2 if separate else 1)
    b = Agent.connect(agents("dec", transports).sock)
    fp = b.register(dst)
    before = [dst.kv_layer(layer).clone() for layer in range(lay.kv.layers)]
    before_conv = [dst.conv(layer).clone() for layer in range(lay.mamba.layers)]
    g = b.grant(60, blocks=[9, 3], row=1, from_tp=2)
    senders = send_from_tp2(agents, whole, g.ticket, layers, transports)
    assert fp == senders[0].fingerprint
    assert b.wait_grant(g, timeout=10).ok
    assert torch.equal(whole.kv[0], dst.kv_block(9)) and torch.equal(whole.kv[1], dst.kv_block(3))
    assert same_row(whole, 4, dst, 1, lay.mamba.layers)
    others = [i for i in range(lay.kv.blocks) if i not in (9, 3)]
    for layer in range(lay.kv.layers):
        assert torch.equal(before[layer][:, others], dst.kv_layer(layer)[:, others])
    for layer in range(lay.mamba.layers):
        rows = [r for r in range(lay.mamba.rows) if r != 1]
        assert torch.equal(before_conv[layer][rows], dst.conv(layer)[rows])

    with pytest.raises(AgentError) as e:
        b.grant(62, blocks=[1], row=7)
    assert e.value.code == "reserved"

    # Back into a block-major engine.
    c, back = engine(agents("back", transports), 32)
    g = c.grant(61, blocks=[5, 6], row=0)
    s = b.send(g.ticket, blocks=[9, 3], row=1)
    assert b.wait_send(s, timeout=10).ok
    assert c.wait_grant(g, timeout=10).ok
    assert torch.equal(back.kv[5], whole.kv[0]) and torch.equal(back.kv[6], whole.kv[1])
    assert same_row(back, 0, whole, 4, lay.mamba.layers)


def test_per_layer_reserved_row_refused(agents):
    b = Agent.connect(agents("dec").sock)
    b.register(LayerPools(tiny_layout()))
    with pytest.raises(AgentError) as e:
        b.grant(62, blocks=[1], row=7)
    assert e.value.code == "reserved"


def test_nhd_order(agents):
    """vLLM's default (and SGLang's) NHD order moves between NHD engines of
    one TP size; an HND engine's ticket is refused by name."""
    nhd = tiny_layout()
    nhd.kv = dataclasses.replace(nhd.kv, order="nhd")
    src, dst = random_layer_pools(nhd, 40), random_layer_pools(nhd, 41)
    assert src.kv_layer(0).shape[2:] == (16, 2, 16)
    a = Agent.connect(agents("pre").sock)
    a.register(src)
    b = Agent.connect(agents("dec").sock)
    b.register(dst)
    g = b.grant(63, blocks=[4], row=2)
    s = a.send(g.ticket, blocks=[8], row=3)
    assert a.wait_send(s, timeout=10).ok
    assert b.wait_grant(g, timeout=10).ok
    assert torch.equal(src.kv_block(8), dst.kv_block(4))
    assert same_row(src, 3, dst, 2, nhd.mamba.layers)
    c, _ = engine(agents("hnd"), 42)
    g = c.grant(64, blocks=[1])
    with pytest.raises(AgentError) as e:
        a.send(g.ticket, blocks=[8])
    assert e.value.code == "layout_mismatch" and "nhd" in str(e.value)


def test_large_request_while_another_thread_waits(agents):
    """A request of megabytes (a million block names) goes whole while
    another thread waits for events with a short deadline: the reader's
    deadline is not the writer's, so the send is not cut off mid-frame
    and the agent answers it."""
    a, _ = engine(agents("pre"), 40)
    stop = threading.Event()

    waits = []

    def waiter():
        while not stop.is_set():
            try:
                a.wait(lambda e: False, timeout=0.0005)
            except queue.Empty:
                waits.append(1)

    t = threading.Thread(target=waiter)
    t.start()
    try:
        for _ in range(3):
            with pytest.raises(AgentError) as e:
                a.grant(70, blocks=[1 << 30] * (1 << 20))
            assert e.value.code == "bad_request"
    finally:
        stop.set()
        t.join()
    assert len(waits) > 10  # the waiter waited throughout
    g = a.grant(71, blocks=[1])  # the connection is still in step
    a.revoke(g)


def test_close_waits_until_memory_is_let_go(agents):
    pb = agents("dec")
    b, dst = engine(pb, 30)
    b.grant(60, blocks=[1, 2], row=1)
    assert b.close() is True  # the agent revoked, unmapped and closed its side
    assert b.close() is False  # once only
    with pytest.raises(AgentClosed):
        b.grant(61, blocks=[1])
    # The same tensors, registered at once: no earlier connection holds them.
    start = time.monotonic()
    b = Agent.connect(pb.sock)
    b.register(dst)
    assert time.monotonic() - start < 2
    b.close()


def test_forked_child_does_not_hold_the_connection(agents):
    """A child forked after connecting closes its copy of the socket: the
    engine that connected exiting ends its registration even while the
    child lives."""
    pb = agents("dec")
    b, dst = engine(pb, 31)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lives on, holding nothing of the parent's
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        # The engine "exits" without closing: its descriptor goes as a dead
        # process's would, no shutdown.
        b._sock.close()
        start = time.monotonic()
        b2 = Agent.connect(pb.sock)
        b2.register(dst)  # waits (up to 5 s, then refused) while another connection holds dst
        assert time.monotonic() - start < 3
        b2.close()
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def _fake_agent(tmp_path, answer: bytes):
    """A socket that answers the first frame it reads with answer, then
    reports whether the client closed the connection."""
    import socket as sk
    import struct

    path = str(tmp_path / "fake.sock")
    srv = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    closed = threading.Event()

    def serve():
        c, _ = srv.accept()
        with c:
            (n,) = struct.unpack(">I", c.recv(4))
            c.recv(n)
            c.sendall(answer)
            c.settimeout(5)
            try:
                while c.recv(1 << 16):
                    pass
                closed.set()
            except OSError:
                pass
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return path, closed


@pytest.mark.parametrize(
    "answer",
    [(64 << 20).to_bytes(4, "big"), (3).to_bytes(4, "big") + b"\xc1\xc1\xc1", (1).to_bytes(4, "big") + b"\x07"],
    ids=["too-long", "undecodable", "not-a-map"],
)
def test_frame_not_the_agents_ends_the_connection(tmp_path, answer):
    path, closed = _fake_agent(tmp_path, answer)
    with pytest.raises(AgentClosed):
        Agent.connect(path, timeout=5)
    assert closed.wait(5), "the client left the connection open"
