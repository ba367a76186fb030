"""Python client of handoff's agent (issue 33).

An engine worker process talks to its agent (``handoff-agent``) over a unix
socket: it registers its cache memory once (:class:`Pools`, torch CPU
tensors backed by memfds, passed by file descriptor), then per request the
receiver opens a grant over named blocks and a row (:meth:`Agent.grant`) and
hands the ticket to the sender, whose agent writes its named blocks and row
into it (:meth:`Agent.send`, or layer by layer with :meth:`Agent.open_send`).
Ends arrive as :class:`Event` objects (:meth:`Agent.next_event`). Pools
that lie on a GPU are registered by CUDA IPC handle instead
(:meth:`Agent.register_cuda`, :func:`cuda_memory`), or by the POSIX fd of a
VMM allocation (:class:`VMMMemory`).
"""

from .client import (
    Agent,
    AgentClosed,
    AgentError,
    Event,
    Grant,
    Peer,
    Send,
)
from .layout import KVLayout, LayerPools, Layout, MambaLayout, Pools, VMMMemory, cuda_memory

__all__ = [
    "Agent",
    "AgentClosed",
    "AgentError",
    "Event",
    "Grant",
    "KVLayout",
    "LayerPools",
    "Layout",
    "MambaLayout",
    "Peer",
    "Pools",
    "Send",
    "VMMMemory",
    "cuda_memory",
]
