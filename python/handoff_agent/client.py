"""The local API of handoff's agent: frames of msgpack over a unix socket."""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import select
import socket
import struct
import threading
import time
import weakref
from typing import Callable, Iterable, Optional, Union

import msgpack
import torch

from .layout import LayerPools, Layout, Pools, VMMMemory, cuda_memory

VERSION = 3  # 2: planes, KV order, registration by buffers; 3: conv order
MAX_BUFFERS = 253  # SCM_MAX_FD: the descriptors one message passes
MAX_FRAME = 16 << 20


class AgentError(Exception):
    """A failure the agent reported: ``code`` names it (``revoked``,
    ``deadline``, ``reserved``, ``layout_mismatch``, ``forbidden``, ...)."""

    def __init__(self, code: str, msg: str):
        super().__init__(f"{msg} ({code})")
        self.code = code
        self.msg = msg


class AgentClosed(AgentError):
    """The connection to the agent is gone (the agent exited or restarted):
    connect to the new one and register again."""

    def __init__(self, msg: str = "connection to the agent closed"):
        super().__init__("closed", msg)


@dataclasses.dataclass
class Event:
    """A grant or a send ended. kind: grant_done, grant_failed, send_done,
    send_failed; code and msg say why a failure failed."""

    kind: str
    grant: int = 0
    send: int = 0
    request_id: int = 0
    bytes: int = 0
    code: str = ""
    msg: str = ""
    ticket: bytes = b""  # kind "ticket": a ticket another agent offered
    agent: str = ""  # kind "ticket": the agent that offered it

    @property
    def ok(self) -> bool:
        return self.kind.endswith("_done")


@dataclasses.dataclass
class Grant:
    id: int
    ticket: bytes


@dataclasses.dataclass
class Peer:
    """Another agent of the namespace's registry (:meth:`Agent.peers`): its
    engine's layout fingerprint and rdma agent id ("" while no engine is
    registered with it) and the transports its data path serves."""

    name: str
    fingerprint: str = ""
    agent_id: str = ""
    transports: list[str] = dataclasses.field(default_factory=list)


class Send:
    """A send in progress. For one opened with :meth:`Agent.open_send`,
    :meth:`layer` queues a finished layer and :meth:`commit` sends the rest
    and commits; its end arrives as an event naming ``id``."""

    def __init__(self, agent: "Agent", id: int):
        self._agent = agent
        self.id = id

    def layer(self, kind: str, layer: int) -> None:
        self._agent._call({"op": "send_layer", "send": self.id, "kind": kind, "layer": layer})

    def kv_layer(self, layer: int) -> None:
        self.layer("kv", layer)

    def mamba_layer(self, layer: int) -> None:
        self.layer("mamba", layer)

    def commit(self) -> None:
        self._agent._call({"op": "commit", "send": self.id})

    def cancel(self) -> None:
        self._agent._call({"op": "cancel", "send": self.id})




# The connections of this process. A child forked from it (a worker
# started by fork) closes its copies of their sockets: a copy held by the
# child would keep a connection open after the engine that made it exited,
# and its grants unrevoked.
_connections: "weakref.WeakSet[Agent]" = weakref.WeakSet()


def _close_inherited() -> None:
    for a in list(_connections):
        try:
            os.close(a._sock.detach())
        except OSError:
            pass
        a._closed = True
    _connections.clear()


os.register_at_fork(after_in_child=_close_inherited)


class Agent:
    """A connection to an agent: one engine registration. Calls are safe
    from several threads; events arrive in order on :meth:`next_event`.

    There is no reader thread: whichever thread waits (for a reply or an
    event) reads the socket itself, queueing what belongs to others, so a
    reply or event reaches the waiting thread without a thread hand-off.
    """

    def __init__(self, path: str, timeout: float = 10.0, wait: float = 0.0):
        deadline = time.monotonic() + wait
        while True:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout)
            try:
                self._sock.connect(path)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                self._sock.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
            except BaseException:
                self._sock.close()
                raise
        self._sock.settimeout(None)
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._timeout = timeout
        self._wlock = threading.Lock()
        self._cond = threading.Condition()
        self._reading = False  # a thread is reading the socket
        self._buf = bytearray()
        self._next = 0
        self._replies: dict[int, dict] = {}
        # Calls that gave up waiting: their replies, when they come, are
        # dropped rather than kept for no one.
        self._abandoned: set[int] = set()
        self._events: "collections.deque[Event]" = collections.deque()
        self._closed = False
        self._closing = False  # close() began: no new calls
        # The agent ended the connection after close() began, as it does
        # once it let the registration's memory go (_released); it said the
        # memory is not safe yet (_held, its "quarantined" event).
        self._eof = False
        self._released = False
        self._held = ""
        _connections.add(self)
        try:
            hello = self._call({"op": "hello", "v": VERSION})
        except BaseException:
            self._shut()
            self._sock.close()
            raise
        self.name = hello.get("agent", "")
        self.fingerprint = ""

    @classmethod
    def connect(cls, path: str, timeout: float = 10.0, wait: float = 0.0) -> "Agent":
        """Connects to the agent at ``path``; ``wait`` seconds for one that
        is (re)starting. ``timeout`` bounds each call."""
        return cls(path, timeout, wait)

    # The connection.

    def _shut(self) -> None:
        """Ends the connection both ways, so that the agent ends the
        registration; the descriptor stays open (another thread may be
        polling it) until close()."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read_frame(self, deadline: Optional[float]) -> Optional[dict]:
        """Reads one frame (the caller is the only reader); None on close,
        or on a frame that is not the agent's (too long, undecodable):
        nothing after it could be trusted to start a frame."""
        while True:
            if len(self._buf) >= 4:
                (n,) = struct.unpack_from(">I", self._buf)
                if n > MAX_FRAME:
                    return None
                if len(self._buf) >= 4 + n:
                    body = bytes(self._buf[4 : 4 + n])
                    del self._buf[: 4 + n]
                    try:
                        msg = msgpack.unpackb(body, raw=False)
                    except Exception:
                        return None
                    if not isinstance(msg, dict):
                        return None
                    return msg
            # poll, not settimeout: the socket's blocking mode is also the
            # writers' (sendall), whom a reader's deadline must not cut off
            # mid-frame.
            wait_ms = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("agent: no message in time")
                wait_ms = max(1, int(left * 1000))
            try:
                if not self._poll.poll(wait_ms):
                    continue  # the deadline is checked again above
                chunk = self._sock.recv(1 << 16)
            except OSError:
                return None
            if not chunk:
                self._eof = True
                return None
            self._buf += chunk

    def _wait(self, take: Callable[[], object], timeout: Optional[float]):
        """Returns take()'s first non-None result, reading the socket when no
        other thread does; raises AgentClosed once the connection is gone
        and take() has nothing, TimeoutError past timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                got = take()
                if got is not None:
                    return got
                if self._closed:
                    raise AgentClosed()
                if not self._reading:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("agent: no answer in time")
                self._cond.wait(left)
            self._reading = True
        try:
            while True:
                try:
                    msg = self._read_frame(deadline)
                except TimeoutError:
                    raise
                with self._cond:
                    if msg is None:
                        self._released = self._closing and self._eof
                        self._closed = True
                        self._shut()
                    elif msg.get("ev"):
                        if msg["ev"] == "quarantined":
                            self._held = msg.get("msg", "") or "quarantined"
                        self._events.append(
                            Event(
                                kind=msg["ev"],
                                grant=msg.get("grant", 0),
                                send=msg.get("send", 0),
                                request_id=msg.get("request_id", 0),
                                bytes=msg.get("bytes", 0),
                                code=msg.get("code", ""),
                                msg=msg.get("msg", ""),
                                ticket=msg.get("ticket", b""),
                                agent=msg.get("agent", ""),
                            )
                        )
                    elif msg.get("re", 0) in self._abandoned:
                        self._abandoned.discard(msg["re"])
                    else:
                        self._replies[msg.get("re", 0)] = msg
                    self._cond.notify_all()
                    got = take()
                    if got is not None:
                        return got
                    if self._closed:
                        raise AgentClosed()
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _call(self, req: dict, fds: Iterable[int] = (), timeout: Optional[float] = -1) -> dict:
        """Sends req and returns its reply; timeout (None: no limit) defaults
        to the connection's."""
        if timeout is not None and timeout < 0:
            timeout = self._timeout
        with self._cond:
            if self._closed or self._closing:
                raise AgentClosed()
            self._next += 1
            cid = req["id"] = self._next
        body = msgpack.packb(req, use_bin_type=True)
        frame = struct.pack(">I", len(body)) + body
        fds = list(fds)
        try:
            with self._wlock:
                if fds:
                    # The descriptors ride with the first bytes; a stream
                    # socket may take fewer than the frame.
                    n = socket.send_fds(self._sock, [frame], fds)
                    self._sock.sendall(frame[n:])
                else:
                    self._sock.sendall(frame)
        except OSError as e:
            # Part of the frame may have gone; nothing after it would be
            # read as the agent's next frame, so the connection ends here.
            self._shut()
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            raise AgentClosed(f"connection to the agent: {e}") from e
        try:
            rep = self._wait(lambda: self._replies.pop(cid, None), timeout)
        except TimeoutError:
            with self._cond:
                if self._replies.pop(cid, None) is None:
                    self._abandoned.add(cid)
            raise TimeoutError(f"agent did not answer {req['op']} in {timeout}s") from None
        if rep.get("code"):
            raise AgentError(rep["code"], rep.get("msg", ""))
        return rep

    def close(self, timeout: Optional[float] = 30.0) -> bool:
        """Ends the registration and waits, up to ``timeout`` seconds (None:
        no limit), for the agent to let its memory go: it revokes this
        engine's grants, waits out any writer still copying into them, unmaps
        the memory, and then closes its side. True then: the tensors may be
        used again, or registered anew. False when that was not confirmed:
        the wait ran out (the agent may still be waiting for such a writer),
        the agent said the memory is not safe yet (a ``quarantined`` event),
        the connection had ended before (the agent stopped or died, or sent
        what is not its frame), or close() was called before: the memory is
        not known to be safe."""
        with self._cond:
            again = self._closing
            self._closing = True
        if again:
            return False
        ok = False
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # gone already: the wait says so
        try:
            self._wait(lambda: None, timeout)
        except AgentClosed:
            ok = self._released and not self._held
        except (TimeoutError, OSError):
            pass
        self._shut()
        self._sock.close()
        _connections.discard(self)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return ok

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # The API.

    def register(self, pools: Union[Pools, LayerPools]) -> str:
        """Registers the pools' memory and layout once (block-major
        :class:`Pools` or per-layer :class:`LayerPools`); returns the layout
        fingerprint (the one handoff's workers compute)."""
        if getattr(pools, "separate", False):
            bufs = pools.buffers()
            if len(bufs) > MAX_BUFFERS:
                raise ValueError(f"{len(bufs)} buffers, at most {MAX_BUFFERS} (descriptors one message passes)")
            rep = self._call(
                {"op": "register", "layout": pools.layout.wire(), "buffers": [{"bytes": n} for _, n in bufs]},
                [fd for fd, _ in bufs],
            )
        else:
            (kv_fd, kv_bytes), (m_fd, m_bytes) = pools.fds()
            fds = [fd for fd in (kv_fd, m_fd) if fd >= 0]
            rep = self._call(
                {"op": "register", "layout": pools.layout.wire(), "kv_bytes": kv_bytes, "mamba_bytes": m_bytes},
                fds,
            )
        self.fingerprint = rep["fingerprint"]
        self.agent_id = rep.get("agent_id", "")
        self.transports = rep.get("transports", [])
        return self.fingerprint

    def register_cuda(
        self,
        layout: Layout,
        kv: Optional[Union[torch.Tensor, VMMMemory]] = None,
        mamba: Optional[Union[torch.Tensor, VMMMemory]] = None,
        buffers: Optional[list[Union[torch.Tensor, VMMMemory]]] = None,
    ) -> str:
        """Registers pools that lie on a GPU, once, by CUDA IPC handle (see
        :func:`cuda_memory`), or for memory of the VMM API by the fd the
        engine exported (a :class:`VMMMemory` where a tensor would go; its
        peers reach it by tcp, as no CUDA IPC handle names it): ``kv`` holds ``layout``'s KV blocks back to
        back and ``mamba`` its rows (the layouts :class:`Pools` gives its
        host tensors), or each where the layout's planes place them (then
        a tensor may hold more than the planes reach). Caches kept in
        tensors of their own (vLLM's per-layer allocations) are passed as
        ``buffers`` instead, which the layout's planes name by index
        ((offset, stride, buffer)). The agent maps them on the same GPU;
        the engine keeps the tensors alive while registered. Returns the
        layout fingerprint."""
        req = {"op": "register", "layout": layout.wire()}
        fds: list[int] = []  # of the VMM allocations, in order

        def device_memory(t) -> dict:
            if isinstance(t, VMMMemory):
                fds.append(t.fd)
                return t.wire()
            return cuda_memory(t)

        if buffers is not None:
            if kv is not None or mamba is not None:
                raise ValueError("pass the pools or buffers, not both")
            if len(buffers) > MAX_BUFFERS:
                raise ValueError(f"{len(buffers)} buffers, at most {MAX_BUFFERS}")
            need = layout.buffer_bytes()
            for b, n in need.items():
                if b >= len(buffers) or buffers[b].nbytes < n:
                    have = buffers[b].nbytes if b < len(buffers) else 0
                    raise ValueError(f"buffer {b} holds {have} bytes, the layout's planes reach {n}")
            req["buffers"] = [{"bytes": t.nbytes, "cuda": device_memory(t)} for t in buffers]
        pools = () if buffers is not None else (
            ("kv", kv, layout.kv_bytes(), layout.kv is not None and layout.kv.planes is not None),
            ("mamba", mamba, layout.mamba_bytes(), layout.mamba is not None and layout.mamba.planes is not None),
        )
        for name, t, want, planes in pools:
            if t is None:
                if want:
                    raise ValueError(f"the layout has a {name} pool, but no {name} tensor was given")
                continue
            if not want:
                raise ValueError(f"a {name} tensor, but the layout has no {name} pool")
            if t.nbytes < want or (t.nbytes > want and not planes):
                raise ValueError(f"the {name} tensor holds {t.nbytes} bytes, the layout {want}")
            req[name + "_bytes"] = t.nbytes
            req[name + "_cuda"] = device_memory(t)
        rep = self._call(req, fds)
        self.fingerprint = rep["fingerprint"]
        self.agent_id = rep.get("agent_id", "")
        self.transports = rep.get("transports", [])
        return self.fingerprint

    def grant(
        self,
        request_id: int,
        blocks: list[int],
        row: Optional[int] = None,
        deadline: Optional[float] = None,
        from_tp: Optional[int] = None,
    ) -> Grant:
        """Opens a grant over ``blocks`` (in token order) and ``row``;
        ``deadline`` in seconds from now; ``from_tp`` the senders' TP size
        when it differs from this engine's: every sender shard gets the same
        ticket and writes its part (the agents reshard). Its end is one
        event, once every shard's part landed."""
        req = {"op": "grant", "request_id": request_id, "blocks": list(blocks)}
        if from_tp is not None:
            req["from_tp"] = from_tp
        if row is not None:
            req["row"] = row
        if deadline is not None:
            req["deadline_ms"] = max(1, int(deadline * 1000))
        rep = self._call(req)
        return Grant(rep["grant"], rep["ticket"])

    def revoke(self, grant: int | Grant) -> None:
        """Revokes a grant: once this returns, no byte of it lands. It raises
        AgentError with code ``quarantined`` when a writer stopped inside a
        copy into it (a frozen process) may still write its blocks: reuse
        them once the grant's ``grant_failed`` event came."""
        gid = grant.id if isinstance(grant, Grant) else grant
        self._call({"op": "revoke", "grant": gid})

    def _open(self, op: str, ticket: bytes, blocks: list[int], row: Optional[int]) -> Send:
        req = {"op": op, "ticket": ticket, "blocks": list(blocks)}
        if row is not None:
            req["row"] = row
        return Send(self, self._call(req)["send"])

    def offer(self, ticket: bytes, to: str) -> None:
        """Has the agent hand ``ticket`` to agent ``to`` over NATS, which
        passes it to its engine as a "ticket" event (:meth:`wait_ticket`);
        returns once it did. Needs agents started with --nats-url."""
        self._call({"op": "offer", "ticket": ticket, "to": to})

    def peers(self) -> list[Peer]:
        """The other agents of the namespace's registry, by name: where this
        engine can send, or ask for a grant (same fingerprint, or another TP
        of the same model). Empty without --nats-url."""
        rep = self._call({"op": "peers"})
        return [
            Peer(
                name=p.get("name", ""),
                fingerprint=p.get("fingerprint", ""),
                agent_id=p.get("agent_id", ""),
                transports=list(p.get("transports") or []),
            )
            for p in rep.get("peers") or []
        ]

    def wait_ticket(self, timeout: Optional[float] = None) -> Event:
        """The next ticket another agent offered this engine."""
        return self.wait(lambda e: e.kind == "ticket", timeout)

    def send(self, ticket: bytes, blocks: list[int], row: Optional[int] = None) -> Send:
        """Writes ``blocks`` and ``row`` into the ticket's, in order; keep
        them unchanged until the send's event."""
        return self._open("send", ticket, blocks, row)

    def send_wait(self, ticket: bytes, blocks: list[int], row: Optional[int] = None, timeout: Optional[float] = None) -> Event:
        """Like :meth:`send`, returning once the receiver accepted the
        commit (its send_done), or raising AgentError with the refusal: one
        message back instead of a reply and an event, for the latency-bound.
        It waits as long as the send takes (the grant's deadline bounds it)
        unless given a timeout; past one, the send goes on unseen."""
        req = {"op": "send", "ticket": ticket, "blocks": list(blocks), "wait": True}
        if row is not None:
            req["row"] = row
        rep = self._call(req, timeout=timeout)
        return Event(kind="send_done", send=rep.get("send", 0), request_id=rep.get("request_id", 0), bytes=rep.get("bytes", 0))

    def open_send(self, ticket: bytes, blocks: list[int], row: Optional[int] = None) -> Send:
        """Starts a layer-by-layer send: Send.kv_layer / mamba_layer as each
        layer is computed, then Send.commit."""
        return self._open("open_send", ticket, blocks, row)

    def next_event(self, timeout: Optional[float] = None) -> Event:
        """The next event; raises AgentClosed once the connection is gone and
        every event before it was taken, queue.Empty on timeout."""
        return self.wait(lambda e: True, timeout)

    def wait(self, match: Callable[[Event], bool], timeout: Optional[float] = None) -> Event:
        """The first event queued that ``match`` accepts, taken out of the
        queue; the others stay queued, in order, for later waits."""

        def take():
            for i, ev in enumerate(self._events):
                if match(ev):
                    del self._events[i]
                    return ev
            return None

        try:
            return self._wait(take, timeout)
        except TimeoutError:
            raise queue.Empty from None

    def wait_grant(self, grant: int | Grant, timeout: Optional[float] = None) -> Event:
        gid = grant.id if isinstance(grant, Grant) else grant
        return self.wait(lambda e: e.kind.startswith("grant_") and e.grant == gid, timeout)

    def wait_send(self, send: int | Send, timeout: Optional[float] = None) -> Event:
        sid = send.id if isinstance(send, Send) else send
        return self.wait(lambda e: e.kind.startswith("send_") and e.send == sid, timeout)
