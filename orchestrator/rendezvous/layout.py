"""Where a rendezvous lives in etcd (`state_key`, `alive_prefix`, `delta_prefix`,
`written_key`, `store_prefix`) and how its nodes are named there (`node_id`), one object per node
(`_node`); what a monitor reads of it (`read_rendezvous`)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, unquote

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from pipetransformer.core import keys
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.rendezvous.codec import decode_state, verify_state

# A node as a plain (addr, pid, local_id) tuple: how deltas name it, and the key of `_node`.
_NodeKey = tuple[str, int, int]


def state_key(run_id: str) -> str:
    """etcd key of the rendezvous state blob of ``run_id``."""
    return f"{keys.rendezvous(run_id)}/state"


def store_prefix(run_id: str) -> str:
    """etcd prefix of the c10d store keys of ``run_id``."""
    return f"{keys.rendezvous(run_id)}/store/"


def alive_prefix(run_id: str) -> str:
    """etcd prefix of the keys a live node holds under its lease (see "Scale"): right after
    the state key, so that one range read returns both."""
    return f"{state_key(run_id)}.alive/"


def delta_prefix(run_id: str) -> str:
    """etcd prefix of the state's deltas (see "Scale"): after the alive keys, so that one range
    read returns both, and the state key itself is not in it."""
    return f"{state_key(run_id)}.delta/"


def written_key(run_id: str) -> str:
    """etcd key written with every state (see "Scale"): its mod revision says whether the state
    changed since a node's last read, at the cost of one key."""
    return f"{keys.rendezvous(run_id)}/written"


def read_rendezvous(
    client: EtcdClient, run_id: str, secret: bytes | None = None
) -> tuple[_RendezvousState | None, set[_NodeDesc], int]:
    """What a monitor sees of a rendezvous (the benchmark; read-only, O(nodes) a call): its
    stored state (verified, unpickled with torch's classes only), the nodes whose lease is
    alive, and the stored state's size in bytes."""
    value = client.get(state_key(run_id))
    state = None
    if value is not None:
        state = decode_state(verify_state(secret, state_key(run_id), value))
    alive = set()
    prefix = alive_prefix(run_id)
    for key, _ in client.get_prefix(prefix):
        node = parse_node_id(key[len(prefix) :])
        if node is not None:
            alive.add(node)
    return state, alive, 0 if value is None else len(value) * 3 // 4


def delete_rendezvous(client: EtcdClient, run_id: str) -> int:
    """Drop the state and store keys of ``run_id`` (a finished run's rendezvous is closed and
    cannot be joined again); returns the number of keys removed."""
    return client.delete_prefix(f"{keys.rendezvous(run_id)}/")


def node_id(node: _NodeDesc) -> str:
    """A node's name in etcd keys (its address quoted: it may hold ':' or '/')."""
    return f"{quote(node.addr, safe='')}:{node.pid}:{node.local_id}"


def parse_node_key(text: str) -> _NodeKey | None:
    """(addr, pid, local_id) of a node's name in etcd keys (`node_id`); None if it is none."""
    addr, _, rest = text.partition(":")
    pid, _, local_id = rest.partition(":")
    try:
        return unquote(addr), int(pid), int(local_id)
    except ValueError:
        return None


def parse_node_id(text: str) -> _NodeDesc | None:
    key = parse_node_key(text)
    return None if key is None else _NodeDesc(*key)


def _key(node: _NodeDesc) -> _NodeKey:
    return (node.addr, node.pid, node.local_id)


def _rank_order(state: _RendezvousState) -> list[_NodeDesc]:
    """The participants in torch's rank order (sorted: the dataclass orders by these fields)."""
    return sorted(state.participants, key=_key)


def _node(nodes: dict[_NodeKey, _NodeDesc], key: Any) -> _NodeDesc:
    """The node of `key`, one object per node (`nodes`): dicts and sets of the state then find
    their keys by identity, not by the dataclass's Python-level hash and equality."""
    node = nodes.get(key)
    if node is None:
        if not (
            type(key) is tuple
            and len(key) == 3
            and type(key[0]) is str
            and type(key[1]) is int
            and type(key[2]) is int
        ):
            raise TypeError("not a node")
        node = nodes.setdefault(key, _NodeDesc(*key))  # atomic: nodes may be shared
    return node


def intern_state(state: _RendezvousState, nodes: dict[_NodeKey, _NodeDesc]) -> None:
    """`state` (changed in place) holding one object per node, those of `nodes` (see `_node`)."""

    def one(node: _NodeDesc) -> _NodeDesc:
        return nodes.setdefault(_key(node), node)

    state.participants = {one(n): r for n, r in state.participants.items()}
    state.wait_list = {one(n) for n in state.wait_list}
    state.redundancy_list = {one(n) for n in state.redundancy_list}
    state.last_heartbeats = {one(n): b for n, b in state.last_heartbeats.items()}


# What every backend of a process shares (see "Scale"): one object per node (`_node`), cleared
# past `_SHARED_MAX` entries (then rebuilt as read), as the lease view's tables are.
_PROCESS_NODES: dict[_NodeKey, _NodeDesc] = {}
_SHARED_MAX = 1 << 16


def _bounded(table: dict) -> dict:
    if len(table) > _SHARED_MAX:
        table.clear()
    return table
