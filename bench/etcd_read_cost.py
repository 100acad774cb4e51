"""What one rendezvous read costs etcd, by what it ranges over: etcd's own CPU per read (from its
process's accounting), side by side, for the reads the etcd3 backend makes
(orchestrator/rendezvous/, "Scale"):

- `span`: a node's read after a change, one range over every alive key and the delta ring with a
  mod-revision filter. etcd applies that filter after loading every key in the range (its
  `applierV3backend.Range` drops the limit and prunes afterwards), so the read costs O(nodes)
  however little it returns; here it returns nothing new.
- `deltas`: the same filter over the delta ring alone (64 keys).
- `count`: the check a waiting node makes first, a count-only range over the span, serializable.

    .venv/bin/python bench/etcd_read_cost.py                  # 1,024 alive keys
    .venv/bin/python bench/etcd_read_cost.py --alive 64,256,1024,2048 --reads 1000

One JSON line (also bench/out/etcd_read_cost.json): per size, etcd's CPU milliseconds per read
of each kind and the client's wall milliseconds, and `span_over_deltas`, the ratio of the two
reads' etcd CPU. The kinds run interleaved in rounds, each round starting with another kind.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, environment, progress, rotated

from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator import rendezvous as rz
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd
from pipetransformer.orchestrator.rendezvous.wire import _prefix_end, _rng

RUN = "read-cost"
KINDS = ("span", "deltas", "count")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fill(client: EtcdClient, alive: int, secret: bytes) -> int:
    """`alive` alive keys and a full delta ring, signed as the backend signs them; the store
    revision after the last write."""
    prefix, ring = rz.alive_prefix(RUN), rz.delta_prefix(RUN)
    for i in range(alive):
        key = f"{prefix}10.0.{i // 256}.{i % 256}_{1000 + i}_0"
        client.put(key, rz.sign_state(secret, key, b"%x" % (7_000_000 + i)))
    delta = b"\x80" * 300  # a delta's size; its content is never read here
    for slot in range(rz.DELTA_SLOTS):
        client.put(f"{ring}{slot}", rz.sign_state(secret, f"{ring}{slot}", delta))
    return int(client.get_with_revision(f"{ring}{rz.DELTA_SLOTS - 1}")[1])  # written last


def _requests(top: int) -> dict[str, Any]:
    start, end = rz.state_key(RUN) + ".", _prefix_end(rz.delta_prefix(RUN))
    ring = rz.delta_prefix(RUN)
    # nothing was written after `top`: the filtered reads return no key, as a read that finds
    # one new delta among a thousand unchanged alive keys nearly does
    return {
        "span": _rng(start, end, min_mod=top + 1).request_range,
        "deltas": _rng(ring, _prefix_end(ring), min_mod=top + 1).request_range,
        "count": _rng(start, end, count_only=True, serializable=True).request_range,
    }


def measure(alive: int, reads: int, rounds: int) -> dict[str, Any]:
    """etcd's CPU and the client's wall time per read of each kind, over `rounds` interleaved
    rounds of `reads` reads each (medians of the rounds)."""
    with tempfile.TemporaryDirectory() as tmp:
        with EmbeddedEtcd(Path(tmp) / "etcd", unsafe_no_fsync=True) as server:
            pid = server.pid
            assert pid is not None
            with EtcdClient(server.endpoint) as client:
                top = _fill(client, alive, secrets.token_bytes(32))
                requests = _requests(top)
                stub = client._client.kvstub  # the backend's own path below the client
                cpu: dict[str, list[float]] = {k: [] for k in KINDS}
                wall: dict[str, list[float]] = {k: [] for k in KINDS}
                for r in range(rounds):
                    for kind in rotated(list(KINDS), r):
                        answer = stub.Range(requests[kind], 10)
                        assert kind == "count" or not answer.kvs, "the filter let keys through"
                        c0, t0 = _cpu_s(pid), time.perf_counter()
                        for _ in range(reads):
                            stub.Range(requests[kind], 10)
                        wall[kind].append(1e3 * (time.perf_counter() - t0) / reads)
                        cpu[kind].append(1e3 * (_cpu_s(pid) - c0) / reads)
    etcd_ms = {k: round(statistics.median(v), 4) for k, v in cpu.items()}
    return {
        "alive_keys": alive,
        "etcd_cpu_ms_per_read": etcd_ms,
        "client_ms_per_read": {k: round(statistics.median(v), 4) for k, v in wall.items()},
        "span_over_deltas": round(etcd_ms["span"] / etcd_ms["deltas"], 2)
        if etcd_ms["deltas"] > 0
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alive", default="1024", help="alive keys, comma-separated sizes")
    parser.add_argument("--reads", type=int, default=1000, help="reads of a kind per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.alive.split(",")]
    except ValueError:
        parser.error(f"--alive {args.alive!r}: comma-separated whole numbers, e.g. 64,1024")
    if any(n < 1 for n in sizes) or args.reads < 1 or args.rounds < 1:
        parser.error("--alive sizes, --reads and --rounds must be at least 1")
    rows = []
    for n in sizes:
        progress(f"{n} alive keys: {args.rounds} rounds of {args.reads} reads of each kind...")
        rows.append(measure(n, args.reads, args.rounds))
        progress(f"{n} alive keys: etcd ms/read {rows[-1]['etcd_cpu_ms_per_read']}")
    emit(
        {
            "benchmark": "etcd_read_cost",
            "sizes": sizes,
            "span_over_deltas": [r["span_over_deltas"] for r in rows],
            "rows": rows,
            "config": {"reads": args.reads, "rounds": args.rounds},
            "environment": environment(),
        },
        save_as="etcd_read_cost.json",
    )


if __name__ == "__main__":
    main()
