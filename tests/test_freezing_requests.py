"""Rank 0 reads a manual freeze request at decision points (trainer/freezing.py) from a real
etcd: the controller retires a request only once it has drained the report, and a decision point
that comes before that must not decide the same request again."""

from __future__ import annotations

from pipetransformer.core import keys
from pipetransformer.core.freeze import FreezeState
from pipetransformer.core.planner import plan_layout
from pipetransformer.core.protocol import FreezeRequest
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import TrainingState
from pipetransformer.core.train_state import TrainState
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.trainer.freezing import Freezing


def test_a_request_is_decided_once_though_it_is_read_again_before_it_is_retired(
    etcd: EtcdClient,
) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "fr",
            "model": {"depth": 4, "dim": 32, "heads": 4},
            "training": {"epochs": 1, "global_batch_size": 16},
            "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
            "freeze": {"policy": "off", "every": 5},
        }
    )
    freezing = Freezing(spec, 0, etcd, "fr", reporter=None)  # type: ignore[arg-type]
    ts = TrainState(TrainingState(), plan_layout(spec).layout, FreezeState())
    request = FreezeRequest(id="r1", layers=2, who="ana", reason="converged")
    etcd.put(keys.freeze_override("fr"), request.model_dump_json())
    first, seen = freezing._on_rank0(ts, None)
    assert seen == request and first.override == "applied" and first.boundary == 2
    again, seen = freezing._on_rank0(ts, None)  # the key is still there: not yet retired
    assert seen is None and again.override is None and again.boundary == ts.boundary
    # another request, filed once the first is retired, is decided
    etcd.put(keys.freeze_override("fr"), request.model_copy(update={"id": "r2"}).model_dump_json())
    later, seen = freezing._on_rank0(ts, None)
    assert seen is not None and seen.id == "r2" and later.override == "applied"
