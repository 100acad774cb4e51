"""torchrun rendezvous over etcd v3: ``--rdzv-backend etcd3 --rdzv-endpoint HOST:PORT``.

torch ships two etcd backends and both speak the v2 HTTP API, which etcd 3.4+ disables by
default; this one speaks v3 (gRPC, through :mod:`edge.etcd_client`). It plugs into
torch's own ``DynamicRendezvousHandler``, so join/last-call/heartbeat/close semantics are
exactly those of the ``c10d`` backend, and it is registered through the
``torchrun.handlers`` entry point (``handler_factory``).

Rendezvous state
    ``DynamicRendezvousHandler`` keeps one pickled state blob and updates it by
    compare-and-swap. We store it base64-encoded at ``keys.rendezvous(run_id) + "/state"``;
    the fencing token is the key's etcd *mod revision*, and ``set_state`` is one etcd
    transaction "if mod_revision == token: put; then read the key back", so a writer holding
    a stale token loses and is handed the winner's state and token in the same round trip.

The store (why an etcd-backed c10d ``Store``)
    The handler also needs a c10d ``Store`` *before* anyone knows who rank 0 is. The agents
    use it for a handful of small operations per round: rank 0 publishes MASTER_ADDR/PORT
    (``RendezvousStoreInfo``), the agents exchange role info and worker ranks, and they meet
    at the exit barrier. The alternatives were a TCPStore hosted by one agent (what ``c10d``
    does: it needs a designated host known in advance, and that agent's death takes the store
    with it, the very failure an elastic job must survive) or a TCPStore started lazily by
    the winner (which needs a store to announce it: circular). Backing the store with etcd
    itself has no special node, survives any agent's loss and costs nothing new to deploy.
    :class:`EtcdStore` implements set/get/add/compare_set/wait/check/multi_get/multi_set/
    num_keys/delete_key with c10d's semantics (blocking reads wait up to the store timeout and
    raise ``DistStoreError``); keys live under ``keys.rendezvous(run_id) + "/store/"``.
    Blocking reads poll with capped backoff (10 ms to 200 ms; to 1 s beyond 64 nodes, where
    every agent waits on torchrun's rank assignment at once) rather than watch: the agents'
    operations are few, and polling is immune to lost watch events across etcd restarts.

    The *workers'* store is not this one either: each round's rank-0 worker hosts a fresh
    TCPStore (torch's store sharing is turned off, see ``create_etcd3_handler`` for why), so
    the hot path of process-group setup never touches etcd.

Trust (the state is signed)
    The state blob is a pickle (torch's format): whoever can write its key could run code in
    every agent. With a job secret (``$PIPETRANSFORMER_RDZV_SECRET``, or a file named by
    ``$PIPETRANSFORMER_RDZV_SECRET_FILE``: a Kubernetes Secret, or the file a local run makes
    per job) every state is written as ``v1:<HMAC-SHA256>:<base64>``, the MAC over the key and
    the bytes, and a state that does not verify (unsigned, another secret, another run's key)
    raises ``RendezvousStateError`` before torch unpickles it; the refusal is put under
    ``keys.alert`` for the controller to record (rdzv conf ``job=<id>``). An attacker can at
    most replay a state this run once wrote, which unpickles to torch's own state class.
    Without a secret (a foreign torchrun job) states are plain base64, as before, and a
    signed one is refused: it cannot be checked. The c10d store's values are not pickles.

Re-rendezvous fixes
    Workers do not share the agent's TCPStore (torch's opt-out, set by
    ``create_etcd3_handler``): their keys would be namespaced by each agent's restart count,
    which diverges between nodes after a worker failure. MASTER_ADDR/PORT are then built fresh
    every round. The handler subclass also drops torch 2.13's cached store info every round
    (it caches it on nodes that are not rank 0, which would point the survivors of a lost
    rank-0 node at the dead node's store when sharing is on).

Scale (why the state is not simply compare-and-swapped by every node)
    torch's handler writes the whole state (every node's descriptor and last heartbeat) for
    each join and each heartbeat, and a writer that loses the race unpickles the winner's
    state, runs its state machine again and writes again. At N nodes a round costs O(N^2)
    writes of an O(N) blob: measured at 256 simulated agents, 156,059 etcd requests and 316 MB
    written in 240 s, and at most 39 of the 256 ever in the round. Bound to its handler
    (``bind``: torchrun's handler, built by ``create_etcd3_handler``), the backend keeps
    torch's state machine and semantics but changes what reaches etcd:

    - A heartbeat is a lease. Each node holds ``state.alive/<node>`` under a lease of
      keep_alive_interval x keep_alive_max_attempt seconds and refreshes it over its etcd
      client's one keep-alive stream, from the handler's heartbeats and waits and from a
      thread of its own (a stalled handler loop must not make a live node dead: that re-forms
      the whole job); the state is never rewritten for a heartbeat. The handler sees every
      node whose lease lives with a heartbeat that never expires (``overlay``, kept up to date
      by what changed rather than rebuilt for all nodes), so torch's own ``_sanitize``
      removes exactly the nodes whose lease lapsed; that mark is never written
      (``persisted``).
    - A node follows the state by its deltas. Every state write also writes what changed
      (``state_diff``: O(what changed); a round that takes its whole wait list, and the ranks
      a completed round hands out, are named rather than listed)
      into a ring of ``DELTA_SLOTS`` keys ``state.delta/<version mod 64>``, signed like the
      state, in the same transaction. A read is one range over the alive keys and the deltas
      (which sort right after the state key, and leave it out) asking only for what changed
      since the last read; a delta that leads on from the revision held is applied
      (``apply_diff``), and the state is read whole only when the node never read it, fell
      further behind than the ring, or finds a write without a delta (an unbound writer
      leaves ``RELOAD``). Without deltas every node read the whole O(N) state after each
      change: 148 MB for one rendezvous at 512 nodes. A delta names nodes as plain tuples,
      read into one object per node (``decode_delta``): unpickling torch's node dataclass,
      and finding it in the state's dicts by its Python-level hash and equality, cost each
      node of a 1,024-node re-rendezvous about 35 ms of CPU.
    - A read the handler makes while it waits (once a second on every waiting node) first
      asks whether anything changed (``StateFollower.unchanged``): the mod revision of one key
      written with every state (``written_key``) and the number of alive keys and deltas, which
      etcd answers from its index. The range over the span costs etcd O(N) (it loads every key
      to filter them): a thousand waiting nodes took a core of etcd's.
    - A lapsed lease shows as a key missing from the read's count, and every node counts it
      within the same second. A node first counts the keys of the likely nodes, one read of
      one key each (``_probe_likely``): nodes that the last write took out of the state, and
      beyond 64 nodes the few participants of a round (the lost node of a re-rendezvous is
      the one that never left the old round). Beyond 64 nodes a lapse it cannot place waits
      a random part of a heartbeat interval for a write that places it (``LeaseView.settle_gone``):
      1,023 nodes each searching at once held a re-rendezvous up for seconds. Searching, a
      node finds up to four lapsed keys by count-only reads of halves of the keys it knows
      (``_find_gone``: about log2(N) reads of a few bytes each), and lists every alive key
      again only past that (at most once per heartbeat interval).
    - A membership change (join, leave, complete, close) is combined. In one transaction a
      node either takes the combiner lock (a key under its lease) or leaves its change as an
      intent (``intent/<node>``, under its lease, signed like the state). The lock holder
      applies its own change and up to ``MAX_BATCH`` pending intents to the current state by
      replaying torch's own operations (``replay``: a change decided on an older state is
      taken only where torch's operation would still take it on the newer one, so the result
      is what the handler would have written after losing the race), writes the state once,
      deletes the intents it applied (each compared by revision: a withdrawn one is never
      applied behind its owner's back), and lets the lock go with the write that carries its
      own change. A waiter polls with a back-off that grows with the intents pending; its
      intent gone means applied (or refused), and the state it then reads says which. Out of
      time, it withdraws its intent and the handler runs its state machine again.
    - The combiner also makes the writes its batch's handlers would make next (``replay``):
      a node leaving a complete round to join the next one (torch's ``next_rendezvous``:
      exit, then join) is queued in the wait list in the same change; a join goes on as
      torch's join operation would (queued when the round is full, completing a round whose
      last call is over); and a round that opens again takes its whole wait list
      (``promote``), as each waiting node's join does on its first sync after. The survivors
      of a lost node then cost one change each and the new round one write, instead of
      three changes each (leave, wait, join) queued behind one another: 4,000 changes
      for 1,023 survivors. Completing (or closing) a round, and a waiting node's join of the
      round that opened, are decided by every node at about the same moment and made by one
      for all: a node that finds the lock held waits for it (or for the change to be made)
      rather than queueing an intent, and a batch of changes all made already writes no
      state.
    - A state is unpickled with torch's rendezvous classes only (``decode_state``).
    - The backends of one process share what they parse: one object per node, the nodes by
      their names in keys, each alive key as read (per secret, key, value, lease and
      revisions), and the last few states, read whole or made by applying a delta (per
      secret, key and value: states are never changed once held). An agent runs one backend;
      a simulator host runs a hundred, and each parsing every other node's alive key, and
      decoding and applying every delta to a state of its own, took most of its CPU.

    A round of N joins is then about N/``MAX_BATCH`` state writes plus one small intent per
    node, each node reads each write's delta once, and a steady round costs each node one lease
    refresh per heartbeat interval and a range read that returns nothing new. Unbound (the
    backend used through torch's ``RendezvousBackend`` interface alone) it is the plain
    compare-and-swap described under "Rendezvous state", so any torchrun job still works on
    it; both kinds of writer fence on the state key's revision and can share a run.
    ``bench/control_plane_scale.py`` measures it (results in ``bench/results/issue26-scale/``).

Options (``--rdzv-conf k=v,...``), besides torch's join_timeout, last_call_timeout,
close_timeout, heartbeat_timeout, keep_alive_interval and keep_alive_max_attempt:

    read_timeout   seconds a blocking store read waits, and how long an etcd outage is ridden
                   out (retries) before a ``RendezvousConnectionError``; default 60, as c10d.
    rpc_timeout    seconds for one etcd RPC; default 5.
    first_call_timeout
                   seconds the first round (a launch) waits for more nodes once ``min`` have
                   joined, where later rounds wait last_call_timeout; default: the same. The
                   nodes of one launch start together, but not at the same moment (a loaded
                   machine, a slow image pull): a short last call that serves recovery well
                   starts a launch narrower than it was asked for, and a node that missed the
                   first round widens the job a round later, re-forming it.
    job            the pipetransformer job the run belongs to: where a refused state is reported.

Modules
    ``codec`` (the signed state: ``load_secret``, ``sign_state``, ``verify_state``;
    ``decode_state`` with torch's classes only), ``layout`` (the run's keys, nodes' names in
    them, ``read_rendezvous``), ``delta`` (``state_diff``, ``apply_diff``, the stored deltas),
    ``replay`` (torch's state machine replayed: ``replay``, ``follow``, ``promote``,
    ``overlay``, ``persisted``), ``wire`` (etcd requests below the client's API), ``leases``
    (the lease view and this node's lease), ``follower`` (the state followed by its deltas, the
    handler's view), ``combiner`` (intents and the combine lock), ``backend``
    (``EtcdRendezvousBackend``, torch's backend interface), ``store`` (``EtcdStore``) and
    ``handler`` (``create_etcd3_handler``). This package's own module holds ``handler_factory``
    and re-exports the public names.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

# ruff: noqa: E402  (the entry point below must precede the torch imports)

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


# torch's rendezvous package, when first imported, loads every ``torchrun.handlers`` entry
# point, this module's ``handler_factory`` included. When *this* module is what imports that
# package first (the controller, tests), the entry point is loaded from a half-initialised
# module; so it is defined before any torch import and looks the real creator up when called.
def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point ``torchrun.handlers:etcd3``; torch calls it with no arguments and
    registers the returned creator."""
    return _create_etcd3_handler_deferred


def _create_etcd3_handler_deferred(params: RendezvousParameters) -> RendezvousHandler:
    # torchrun's agent, ending, would hold its exit (and the launcher waiting on it) a second
    # in the interpreter's last collection over torch's objects, which nothing needs: the
    # collector skips whatever exists once the exit handlers run (registered once)
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    return create_etcd3_handler(params)


from pipetransformer.orchestrator.rendezvous.backend import BACKEND_NAME, EtcdRendezvousBackend
from pipetransformer.orchestrator.rendezvous.codec import (
    decode_state,
    encode_state,
    load_secret,
    sign_state,
    verify_state,
)
from pipetransformer.orchestrator.rendezvous.delta import (
    RELOAD,
    apply_diff,
    decode_delta,
    encode_delta,
    state_diff,
)
from pipetransformer.orchestrator.rendezvous.follower import DELTA_SLOTS
from pipetransformer.orchestrator.rendezvous.handler import create_backend, create_etcd3_handler
from pipetransformer.orchestrator.rendezvous.layout import (
    alive_prefix,
    delete_rendezvous,
    delta_prefix,
    node_id,
    read_rendezvous,
    state_key,
    store_prefix,
    written_key,
)
from pipetransformer.orchestrator.rendezvous.replay import (
    ALIVE,
    MEMBERSHIP_ACTIONS,
    action_valid,
    apply_action,
    overlay,
    persisted,
    replay,
    sanitize,
)
from pipetransformer.orchestrator.rendezvous.store import EtcdStore

__all__ = [
    "ALIVE",
    "BACKEND_NAME",
    "DELTA_SLOTS",
    "MEMBERSHIP_ACTIONS",
    "RELOAD",
    "EtcdRendezvousBackend",
    "EtcdStore",
    "action_valid",
    "alive_prefix",
    "apply_action",
    "apply_diff",
    "create_backend",
    "create_etcd3_handler",
    "decode_delta",
    "decode_state",
    "delete_rendezvous",
    "delta_prefix",
    "encode_delta",
    "encode_state",
    "handler_factory",
    "load_secret",
    "node_id",
    "overlay",
    "persisted",
    "read_rendezvous",
    "replay",
    "sanitize",
    "sign_state",
    "state_diff",
    "state_key",
    "store_prefix",
    "verify_state",
    "written_key",
]
