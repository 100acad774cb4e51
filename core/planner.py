"""The one planning entry point: which `Layout` a job runs under, for the controller and the
workers alike. Pure and deterministic (no torch, no I/O): measurements come in as `profiles`
(`trainer.profile.measured_layout` measures what `profile_sizes` asks for and calls this).

`plan_layout(spec, world=, boundary=, current=, profiles=)` tells four situations apart by its
arguments; each is what one call site needs:

* initial (`world` None, no `profiles`): the spec's `stages x virtual_stages` stages with the even
  split (`uniform_partition`: earlier stages take the remainder), placed on ranks as the schedule
  expects, `parallel.replicas` replicas, version 1. With `microbatches: auto` the count is
  provisional (the smallest candidate for `parallel.stages`) until the workers measure. The
  controller records it when a job is created or first published.
* re-formed world (`world` given, no `profiles`): `world` workers after a node was lost or came
  back, blocks [0, boundary) frozen and out of the pipeline, the rest split evenly, whatever
  `freeze.relayout` says, but for 'off': there the frozen blocks never leave the pipeline (all
  blocks are split evenly and [0, boundary) stay frozen in their stages), so that its later
  freezes can keep stage 0 at block 0. The current pipeline depth is kept where it divides the
  world (the rest become replicas), else shallower depths are tried, then deeper ones; the
  current micro-batch count is kept where the replica batch and the schedule allow it, else the
  first candidate the schedule accepts. Version current + 1 (1 without a current layout). The
  controller's answer to a new rendezvous.
* start-up measurement (`profiles`, `boundary` 0 and `world` the spec's world): AutoPipe on the
  measured profiles with S and R fixed to the spec's (the launched world): the partition when
  `parallel.partition` is 'autopipe' (else the current layout's cuts stay), the micro-batch count
  when it is 'auto' (else the spec's). Marked `planner="autopipe"`, version current + 1.
* re-layout (`profiles` otherwise: after a freeze, or a re-formed world the workers measure),
  as `freeze.relayout` says:
  - 'elastic' (AutoPipe + AutoDP): every S' x R' = world with S' <= active blocks and R'
    dividing the batch is planned (cuts only after the boundary, the frozen prefix out of the
    pipeline; the spec's micro-batch count where it divides the replica batch, else the
    candidates), and the lowest predicted step time wins (ties: fewer stages).
  - 'repartition' (AutoPipe without AutoDP): the same with one shape, the current layout's
    replicas R and S' = world / R pipeline ranks (its stages per rank kept): the frozen prefix
    leaves the pipeline and the active blocks are re-partitioned over as many stages as before.
    PlanError when fewer blocks stay active than there are stages.
  - 'off': nothing is measured (`profile_sizes` is empty; `needs_measurement` is False for a
    layout this situation would re-plan): the current stages, ranks, replicas and micro-batch
    count stay and only the freeze boundary moves (blocks [0, boundary) frozen in place, stage 0
    still starting at block 0; the planner mark stays the current one).
  'elastic' and 'repartition' are marked `planner="autopipe"`; all three are version
  current + 1.

`needs_measurement(spec, layout)` says whether a worker should measure before training under an
assigned layout; then, and at every re-layout, it calls `trainer.profile.measured_layout` with
the same `world`, `boundary` and `current` (which measures nothing when `profile_sizes` is
empty). Raises PlanError, saying why, when nothing fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from pipetransformer.core.partition import (
    CostModel,
    Plan,
    PlanError,
    Profile,
    microbatch_candidates,
    plan,
    uniform_partition,
)
from pipetransformer.core.spec import SCHEDULES, JobSpec, schedule_problem
from pipetransformer.core.state import Layout

__all__ = [
    "PlanError",
    "Planned",
    "cost_model",
    "initial_ranges",
    "needs_measurement",
    "plan_layout",
    "profile_sizes",
    "recompute_flags",
]

Situation = Literal["initial", "reformed", "startup", "relayout"]


class Planned(NamedTuple):
    """A layout and the one-line reason the layout record keeps for it; where it was planned
    from measurement, the forward and backward seconds per step the cost model predicts for
    each of its stages (what the Pipeline view sets beside the measured ones)."""

    layout: Layout
    reason: str
    predicted_stage_s: tuple[float, ...] | None = None


def _predicted(best: Plan) -> tuple[float, ...]:
    """Per stage, the cost model's computation per micro-batch times the micro-batches: its
    forward and backward seconds per step (transfers apart)."""
    return tuple(c * best.microbatches for c in best.stage_compute_s)


def initial_ranges(spec: JobSpec) -> list[tuple[int, int]]:
    """The block ranges of the spec's own stages (the even split): what the initial layout runs
    and what per-stage settings in the spec (a `recompute` list) are written for."""
    return uniform_partition(spec.model.depth, spec.parallel.num_stages)


def cost_model(spec: JobSpec, boundary: int) -> CostModel:
    """The planner's cost model for a job with blocks [0, boundary) frozen."""
    p = spec.parallel
    return CostModel(freeze_boundary=boundary, schedule=p.schedule, recompute=p.recomputes_any)


def needs_measurement(spec: JobSpec, layout: Layout) -> bool:
    """Whether workers should re-plan `layout` from measurement before training under it: the
    spec asks for AutoPipe or an automatic micro-batch count, and it was not measured yet."""
    p = spec.parallel
    if spec.freeze.relayout == "off":
        # re-layouts keep the layout as it is: only the spec's own world at F = 0 is planned
        world, f = layout.world_size, layout.freeze_boundary
        if _situation(spec, world, f, measured=True) == "relayout":
            return False
    return layout.planner != "autopipe" and (p.partition == "autopipe" or p.microbatches == "auto")


def _situation(spec: JobSpec, world: int | None, boundary: int, measured: bool) -> Situation:
    if not measured:
        return "initial" if world is None else "reformed"
    if boundary == 0 and world == spec.parallel.world_size:
        return "startup"
    return "relayout"


def plan_layout(
    spec: JobSpec,
    *,
    world: int | None = None,
    boundary: int = 0,
    current: Layout | None = None,
    profiles: Mapping[int, Profile] | None = None,
) -> Planned:
    """The layout for `spec` in the situation the arguments describe (module docstring):
    initial (no `world`), re-formed world (`world`), start-up measurement or re-layout
    (`profiles`, measured at the sizes `profile_sizes` names; `world` defaults to the spec's and
    `current` is required). Raises PlanError when nothing fits, ValueError on contradictory
    arguments."""
    if profiles is not None and world is None:
        world = spec.parallel.world_size
    situation = _situation(spec, world, boundary, profiles is not None)
    if situation == "initial":
        if current is not None or boundary:
            raise ValueError("the initial layout takes no current layout or boundary: pass world")
        return Planned(_initial(spec), "initial")
    assert world is not None
    if situation == "reformed":
        return _reformed(spec, world, boundary, current)
    if current is None:
        raise ValueError("a measured plan replaces a current layout: pass current")
    assert profiles is not None
    if situation == "startup":
        return _startup(spec, boundary, current, profiles)
    return _relayout(spec, world, boundary, current, profiles)


def profile_sizes(
    spec: JobSpec,
    *,
    world: int | None = None,
    boundary: int = 0,
    current: Layout | None = None,
) -> set[int]:
    """The micro-batch sizes (samples) a measured `plan_layout` with these arguments needs
    profiles at: none for a re-layout under `freeze.relayout: off`; `current` is needed for one
    under 'repartition' (its replicas are kept). Raises PlanError when no shape fits the world
    (before anything is measured)."""
    world = spec.parallel.world_size if world is None else world
    gb = spec.training.global_batch_size
    if _situation(spec, world, boundary, measured=True) == "startup":
        replica_batch = gb // spec.parallel.replicas
        return {replica_batch // m for m in _startup_counts(spec)}
    if spec.freeze.relayout == "off":
        return set()
    counts = _relayout_counts(spec, world, boundary, current)
    if _forced(counts) is not None:
        return set()  # one shape of one stage: nothing to choose, nothing to measure
    return {gb // r // m for (_, r), ms in counts.items() for m in ms}


def recompute_flags(spec: JobSpec, layout: Layout) -> list[bool]:
    """Activation recomputation per stage of `layout`. A per-stage list in the spec is written
    for the spec's own stages (`initial_ranges`); once a re-layout or a recovery changes the
    stages, it carries over by block: a new stage recomputes if any of its blocks was in a
    recomputing stage."""
    flags = spec.parallel.recompute
    if isinstance(flags, bool):
        return [flags] * layout.num_stages
    per_block = [False] * layout.num_blocks
    for (start, end), flag in zip(initial_ranges(spec), flags, strict=True):
        per_block[start:end] = [flag] * (end - start)
    return [any(per_block[s.start : s.end]) for s in layout.stages]


# ----------------------------------------------------------------------------------------------
# The four situations


def _initial(spec: JobSpec) -> Layout:
    p = spec.parallel
    m = p.microbatches
    if m == "auto":
        m = microbatch_candidates(p.stages, spec.training.global_batch_size // p.replicas)[0]
    return Layout.build(
        initial_ranges(spec),
        num_blocks=spec.model.depth,
        replicas=p.replicas,
        microbatches=m,
        schedule=p.schedule,
        virtual_stages=p.virtual_stages,
        placement=SCHEDULES[p.schedule].placement,
        version=1,
    )


def _world_shapes(preferred: int, world: int) -> list[int]:
    """Pipeline depths dividing `world`, in the order a re-formed job tries them: the current
    depth first, then shallower ones (more replicas), then deeper ones."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return sorted(divs, key=lambda d: (d > preferred, -d if d <= preferred else d))


def _reformed(spec: JobSpec, world: int, boundary: int, current: Layout | None) -> Planned:
    p = spec.parallel
    L, f, gb = spec.model.depth, boundary, spec.training.global_batch_size
    if world < 1:
        raise PlanError(f"no workers to plan for (world {world})")
    preferred = current.pipeline_ranks if current is not None else p.stages
    virtual = current.virtual_stages if current is not None else p.virtual_stages
    m_now = current.microbatches if current is not None else p.microbatches
    # where the pipeline starts: after the frozen prefix, or at block 0 when frozen blocks stay
    # in their stages (`freeze.relayout: off`, whose later freezes keep stage 0 at block 0)
    lo = 0 if spec.freeze.relayout == "off" else f
    why: list[str] = []
    for depth in _world_shapes(preferred, world):
        replicas, stages = world // depth, depth * virtual
        if stages > L - lo:
            what = "blocks" if lo == 0 else "active blocks"
            why.append(f"{depth}x{replicas}: {stages} stages > {L - lo} {what}")
            continue
        if gb % replicas:
            why.append(f"{depth}x{replicas}: batch {gb} does not split into {replicas} replicas")
            continue
        options = microbatch_candidates(stages, gb // replicas)
        if m_now != "auto" and (gb // replicas) % m_now == 0:
            options = [m_now, *options]
        m = next(
            (m for m in options if schedule_problem(p.schedule, depth, virtual, m) is None), None
        )
        if m is None:
            why.append(f"{depth}x{replicas}: no micro-batch count suits {p.schedule!r}")
            continue
        ranges = [(a + lo, b + lo) for a, b in uniform_partition(L - lo, stages)]
        layout = Layout.build(
            ranges,
            num_blocks=L,
            replicas=replicas,
            microbatches=m,
            schedule=p.schedule,
            virtual_stages=virtual,
            placement=SCHEDULES[p.schedule].placement,
            version=(current.version + 1) if current is not None else 1,
            freeze_boundary=f,
        )
        reason = f"re-formed for {world} worker(s)"
        if current is not None and current.freeze_boundary != f:
            reason += f" at the resumed checkpoint's freeze boundary {f}"
        return Planned(layout, reason)
    raise PlanError(f"no layout fits {world} worker(s): " + "; ".join(why))


def _restrict(profiles: Mapping[int, Profile], sizes: set[int]) -> dict[int, Profile]:
    """The profiles at `sizes` when all were measured; else all of them (the planner then
    interpolates between the measured sizes)."""
    if sizes <= profiles.keys():
        return {b: profiles[b] for b in sizes}
    return dict(profiles)


def _startup_counts(spec: JobSpec) -> list[int]:
    p = spec.parallel
    if p.microbatches != "auto":
        return [p.microbatches]
    return microbatch_candidates(p.stages, spec.training.global_batch_size // p.replicas)


def _startup(
    spec: JobSpec, boundary: int, current: Layout, profiles: Mapping[int, Profile]
) -> Planned:
    p, gb = spec.parallel, spec.training.global_batch_size
    counts = _startup_counts(spec)
    keep_cuts = None if p.partition == "autopipe" else [s.start for s in current.stages[1:]]
    best = plan(
        _restrict(profiles, {gb // p.replicas // m for m in counts}),
        devices=p.world_size,
        global_batch=gb,
        cost=cost_model(spec, boundary),
        microbatches=counts,
        stages=p.stages,
        replicas=p.replicas,
        allowed_cuts=keep_cuts,
    )
    layout = best.to_layout(version=current.version + 1, schedule=p.schedule)
    return Planned(
        layout.model_copy(update={"planner": "autopipe"}),
        f"autopipe: {best.summary()}",
        _predicted(best),
    )


def _relayout_counts(
    spec: JobSpec, world: int, boundary: int, current: Layout | None = None
) -> dict[tuple[int, int], list[int]]:
    """Micro-batch counts to try per (stages, replicas) shape of `world` a re-layout considers
    (stages: model chunks per replica)."""
    if spec.freeze.relayout == "repartition":
        if current is None:
            raise ValueError("a 'repartition' re-layout keeps the current replicas: pass current")
        return _repartition_counts(spec, world, boundary, current)
    L, f = spec.model.depth, boundary
    gb = spec.training.global_batch_size
    shapes = [
        (s, world // s)
        for s in range(1, world + 1)
        if world % s == 0 and s <= L - f and gb % (world // s) == 0
    ]
    if not shapes:
        raise PlanError(f"no stages x replicas = {world} fits {L - f} active blocks and batch {gb}")
    return {(s, r): _microbatch_options(spec, s, r) for s, r in shapes}


def _forced(counts: Mapping[tuple[int, int], Sequence[int]]) -> tuple[int, int] | None:
    """(replicas, micro-batches) when a re-layout has a single candidate, one stage of one
    micro-batch count (a job on one device per replica: its stage is [F, L) whatever is
    measured), else None."""
    if len(counts) != 1:
        return None
    (stages, replicas), ms = next(iter(counts.items()))
    return (replicas, ms[0]) if stages == 1 and len(ms) == 1 else None


def _microbatch_options(spec: JobSpec, stages: int, replicas: int) -> list[int]:
    """The micro-batch counts a re-layout tries for `stages` x `replicas`: the spec's count
    where it divides the replica batch, else the candidates for that depth."""
    m, replica_batch = spec.parallel.microbatches, spec.training.global_batch_size // replicas
    if m != "auto" and replica_batch % m == 0:
        return [m]
    return microbatch_candidates(stages, replica_batch)


def _repartition_counts(
    spec: JobSpec, world: int, boundary: int, current: Layout
) -> dict[tuple[int, int], list[int]]:
    """The one shape a 'repartition' re-layout plans: the current replicas R, world / R
    pipeline ranks with the current stages per rank; the micro-batch counts the schedule takes."""
    p, L, f = spec.parallel, spec.model.depth, boundary
    gb = spec.training.global_batch_size
    r, virtual = current.replicas, current.virtual_stages
    if world % r or gb % r:
        raise PlanError(
            f"freeze.relayout 'repartition' keeps {r} replica(s), which do not divide "
            f"{world} worker(s) and batch {gb}"
        )
    depth = world // r
    stages = depth * virtual
    if stages > L - f:
        raise PlanError(
            f"freeze.relayout 'repartition' keeps {r} replica(s) of {stages} stage(s) on "
            f"{world} worker(s), but freezing blocks 0..{f - 1} leaves {L - f} of {L} blocks "
            "active: every stage needs an active block; raise freeze.keep_trainable to at "
            f"least {stages} or use freeze.relayout 'elastic'"
        )
    options = _microbatch_options(spec, stages, r)
    counts = [m for m in options if schedule_problem(p.schedule, depth, virtual, m) is None]
    if not counts:
        raise PlanError(
            f"freeze.relayout 'repartition': no micro-batch count of {options} suits "
            f"{p.schedule!r} on {depth} rank(s) x {virtual} stage(s)"
        )
    return {(stages, r): counts}


def _in_place(boundary: int, current: Layout) -> Planned:
    """`freeze.relayout: off`: the current layout with blocks [0, boundary) frozen in place."""
    if current.stages[0].start not in (0, boundary):
        raise PlanError(
            f"freeze.relayout 'off' keeps the stages, but stage 0 of layout v{current.version} "
            f"starts at block {current.stages[0].start}, not at 0 or the boundary {boundary}"
        )
    data = current.model_dump() | {"version": current.version + 1, "freeze_boundary": boundary}
    layout = Layout.model_validate(data)
    shape = f"{layout.pipeline_ranks}x{layout.replicas}"
    return Planned(
        layout,
        f"F={boundary}: frozen in place (freeze.relayout off): {shape} stages and "
        f"{layout.microbatches} micro-batches kept",
    )


def _relayout(
    spec: JobSpec, world: int, boundary: int, current: Layout, profiles: Mapping[int, Profile]
) -> Planned:
    if spec.freeze.relayout == "off":
        return _in_place(boundary, current)
    p, L, f = spec.parallel, spec.model.depth, boundary
    gb = spec.training.global_batch_size
    cost = cost_model(spec, f)
    counts = _relayout_counts(spec, world, f, current)
    forced = _forced(counts)
    if forced is not None:
        replicas, m = forced
        layout = Layout.build(
            [(f, L)],
            num_blocks=L,
            replicas=replicas,
            microbatches=m,
            schedule=p.schedule,
            version=current.version + 1,
            freeze_boundary=f,
            planner="autopipe",
        )
        shape = f"1x{replicas}, {m} micro-batch(es)"
        return Planned(layout, f"F={f}: {shape}, the only shape for {world} worker(s)")
    # 'elastic' shapes have one stage per rank; 'repartition' keeps the current stages per rank
    # (the cost model plans one stage per device, so each model chunk is planned as its own)
    virtual = current.virtual_stages if spec.freeze.relayout == "repartition" else 1
    plans = [
        plan(
            _restrict(profiles, {gb // r // m for m in ms}),
            devices=s * r,
            global_batch=gb,
            cost=cost,
            microbatches=ms,
            stages=s,
            replicas=r,
            allowed_cuts=range(f + 1, L),
        )
        for (s, r), ms in counts.items()
    ]
    best = min(plans, key=lambda pl: (pl.step_time_s, pl.stages))
    ranges = [(max(a, f), b) for a, b in best.ranges]  # frozen blocks leave the pipeline
    layout = Layout.build(
        ranges,
        num_blocks=L,
        replicas=best.replicas,
        microbatches=best.microbatches,
        schedule=p.schedule,
        virtual_stages=virtual,
        placement=SCHEDULES[p.schedule].placement if virtual > 1 else "loop",
        version=current.version + 1,
        freeze_boundary=f,
        planner="autopipe",
    )
    reason = f"F={f}: {best.summary()}"
    if spec.freeze.relayout == "repartition":
        reason += f" (repartition: {best.replicas} replica(s) kept)"
    return Planned(layout, reason, _predicted(best))
