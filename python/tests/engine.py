"""A stand-in engine worker for the integration test (integration/agent_test.go).

It owns torch CPU cache tensors shaped like tiny-hybrid's (random contents,
fixed seed), registers them with its agent, and obeys one JSON command per
line on stdin, answering one JSON line on stdout: the test plays the
engines' scheduler, carrying tickets from one engine to the other.
"""

import dataclasses
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from conftest import load_shard  # noqa: E402
from handoff_agent import Agent, AgentError, KVLayout, Layout, MambaLayout, Pools  # noqa: E402


def layout(cfg) -> Layout:
    kv = cfg.get("kv", {})
    return Layout(
        model="tiny-hybrid",
        revision="test",
        pattern="M*M-M*-",
        vocab=256,
        tp_rank=cfg.get("tp_rank", 0),
        tp_size=cfg.get("tp_size", 1),
        kv=KVLayout(
            layers=2, kv_heads=kv.get("kv_heads", 2), head_dim=kv.get("head_dim", 16),
            tokens_per_block=16, dtype=kv.get("dtype", "float32"), blocks=cfg.get("blocks", 64),
        ),
        mamba=MambaLayout(
            layers=3, heads=4, head_dim=16, d_state=16, n_groups=2, d_conv=4,
            conv_dtype="float32", ssm_dtype="float32", rows=8, reserved=[7],
        ),
    )


def _ev(ev) -> dict:
    d = dict(ev.__dict__)
    d["ticket"] = d["ticket"].hex()
    return d


class Engine:
    def __init__(self):
        self.agent = None
        self.pools = None
        self.sends = {}

    def cmd_start(self, c):
        """Random caches from the seed: the whole model's (TP 1), of which a
        TP shard keeps its part, so shards of one seed are one model's."""
        lay = layout(c)
        whole_lay = layout({**c, "tp_rank": 0, "tp_size": 1})
        whole = Pools(whole_lay)
        g = torch.Generator().manual_seed(c.get("seed", 1))
        kv = whole.kv
        kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))
        for layer in range(whole_lay.mamba.layers):
            whole.conv(layer).copy_(torch.randn(whole.conv(layer).shape, generator=g))
            whole.ssm(layer).copy_(torch.randn(whole.ssm(layer).shape, generator=g))
        if lay.tp_size == 1:
            self.pools = whole
        else:
            self.pools = Pools(lay)
            load_shard(self.pools, whole)
        self.whole = whole
        return self.cmd_connect(c)

    def cmd_connect(self, c):
        if self.agent is not None:
            self.agent.close()
        self.agent = Agent.connect(c["socket"], wait=c.get("wait", 0))
        fp = self.agent.register(self.pools)
        return {"fingerprint": fp, "agent_id": self.agent.agent_id, "pid": os.getpid()}

    def cmd_grant(self, c):
        g = self.agent.grant(c["request_id"], c["blocks"], c.get("row"), c.get("deadline"), c.get("from_tp"))
        return {"grant": g.id, "ticket": g.ticket.hex()}

    def cmd_offer(self, c):
        self.agent.offer(bytes.fromhex(c["ticket"]), c["to"])
        return {}

    def cmd_peers(self, c):
        return {"peers": [dataclasses.asdict(p) for p in self.agent.peers()]}

    def cmd_wait_ticket(self, c):
        ev = self.agent.wait_ticket(timeout=c.get("timeout", 30))
        return {"ticket": ev.ticket.hex(), "request_id": ev.request_id, "agent": ev.agent}

    def cmd_revoke(self, c):
        self.agent.revoke(c["grant"])
        return {}

    def cmd_send(self, c):
        t = bytes.fromhex(c["ticket"])
        start = time.perf_counter()
        if c.get("partial"):
            # A send cut short: the first layers only, no commit yet.
            s = self.agent.open_send(t, c["blocks"], c.get("row"))
            s.kv_layer(0)
            s.mamba_layer(0)
            self.sends[s.id] = s
            return {"send": s.id}
        if c.get("send_wait"):
            ev = self.agent.send_wait(t, c["blocks"], c.get("row"))
            return {"seconds": time.perf_counter() - start, **_ev(ev)}
        if c.get("layers"):
            s = self.agent.open_send(t, c["blocks"], c.get("row"))
            order = [("mamba", 0), ("kv", 0), ("mamba", 1), ("mamba", 2), ("kv", 1)]
            for kind, layer in order:
                s.layer(kind, layer)
            s.commit()
        else:
            s = self.agent.send(t, c["blocks"], c.get("row"))
        if not c.get("wait", True):
            return {"send": s.id}
        ev = self.agent.wait_send(s, timeout=c.get("timeout", 30))
        return {"send": s.id, "seconds": time.perf_counter() - start, **_ev(ev)}

    def cmd_commit(self, c):
        self.sends.pop(c["send"]).commit()
        return {}

    def cmd_wait(self, c):
        if c["kind"] == "grant":
            ev = self.agent.wait_grant(c["id"], timeout=c.get("timeout", 30))
        else:
            ev = self.agent.wait_send(c["id"], timeout=c.get("timeout", 30))
        return _ev(ev)

    def cmd_small(self, c):
        """Times sends of one block and one row, one per ticket in turn, "gap"
        seconds apart: from the call to the send_done event (the receiver
        verified the commit). "times" lists them in order."""
        times = []
        for t in c["tickets"]:
            time.sleep(c.get("gap", 0))
            start = time.perf_counter()
            if c.get("wait"):
                self.agent.send_wait(bytes.fromhex(t), [c["src_block"]], c["src_row"])
            else:
                s = self.agent.send(bytes.fromhex(t), [c["src_block"]], c["src_row"])
                ev = self.agent.wait_send(s, timeout=10)
                if not ev.ok:
                    raise AgentError(ev.code, ev.msg)
            times.append(time.perf_counter() - start)
        s = sorted(times)
        return {"p50": s[len(s) // 2], "min": s[0], "times": times}

    def cmd_digest(self, c):
        """sha256 of the named blocks and row; with "whole", of the whole
        model's (TP 1) that this shard was cut from."""
        pools = self.whole if c.get("whole") else self.pools
        h = hashlib.sha256()
        for b in c.get("blocks", []):
            h.update(pools.kv[b].contiguous().view(torch.uint8).numpy().tobytes())
        if c.get("row") is not None:
            h.update(pools.mamba[c["row"]].numpy().tobytes())
        return {"sha": h.hexdigest()}

    def cmd_close(self, c):
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        return {}


def main():
    e = Engine()
    for line in sys.stdin:
        c = json.loads(line)
        try:
            out = getattr(e, "cmd_" + c["cmd"])(c)
        except AgentError as err:
            out = {"error": err.code, "msg": err.msg}
        except Exception as err:  # the test reads it
            out = {"error": type(err).__name__, "msg": str(err)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
