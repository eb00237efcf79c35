"""Which ranks of a torchrun job still answer, once a collective has failed: a rank of
another machine that died leaves its peers only "a peer's connection failed" or a
timeout, which names none. At join, every rank files its node (torchrun's GROUP_RANK)
in the job's store; after a failure, every rank still alive files that it answers and
waits a moment for the others; those that did not are named, by node."""

from datetime import timedelta
import time

import torch.distributed as dist

# How long the ranks still alive wait for each other's answer: they see the failure
# within moments of each other (the same collective breaks on all), on a busy host a
# second or so apart.
ANSWER_WAIT_S = 2.0

# What a lost peer's error says: a wrapped collective's CollectiveTimeout; a plain one's
# (a barrier, an object gather) raw Gloo text, a RuntimeError.
PEER_LOST_WORDS = ("timeout", "timed out", "connection closed", "connection reset", "broken pipe", "aborted",
                   "read error", "write error")

_job: tuple[dist.Store, int, int] | None = None   # the store, this rank, the world


def looks_like_a_lost_peer(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, (TimeoutError, dist.DistError)) or (
        isinstance(error, RuntimeError) and any(word in text for word in PEER_LOST_WORDS))


def enrol(store: dist.Store, rank: int, world: int, node: str | None) -> None:
    """Files this rank's node in the job's `store` (keyed by this restart of the job)."""
    global _job
    store.set(f"census/node/{rank}", node or "")
    _job = (store, rank, world)


def describe_by_node(ranks: list[int], nodes: list[str | None]) -> str:
    """"node 1 (ranks 2, 3)" for each node among `ranks` (its name in `nodes`, by
    rank; None: not known), or "ranks 2, 3" where no node is known."""
    by_node: dict[str | None, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(nodes[rank], []).append(rank)
    words = []
    for node, members in by_node.items():
        listed = f"rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))}"
        words.append(listed if node is None else f"node {node} ({listed})")
    return "; ".join(words)


def unanswered(wait_s: float = ANSWER_WAIT_S) -> str | None:
    """After a failed collective: the ranks that did not answer within `wait_s`, by
    node ("node 1 (ranks 2, 3)"); "" when all did; None when this rank never enrolled.
    When the store itself no longer answers, its node (the rendezvous endpoint's) is
    the one lost, whose ranks cannot be told: that is said instead."""
    if _job is None:
        return None
    store, rank, world = _job
    try:
        store.set_timeout(timedelta(seconds=wait_s))
        store.set(f"census/answers/{rank}", "1")
        keys = [f"census/answers/{r}" for r in range(world)]
        deadline = time.monotonic() + wait_s
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        silent = [r for r in range(world) if not store.check([keys[r]])]
        # A rank that died before it enrolled has no node on file.
        nodes = [store.get(f"census/node/{r}").decode() or None if store.check([f"census/node/{r}"]) else None
                 for r in range(world)]
    except (RuntimeError, dist.DistError):
        return "the job's store (the rendezvous endpoint's node)"
    return describe_by_node(silent, nodes)
