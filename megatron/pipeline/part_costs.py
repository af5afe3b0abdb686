"""The parts' costs from what the profiling window measured: every rank's ``PartTimer`` samples and the stage profile
combined into the profile's ``parts`` entry (``combine_parts``; ``zb_pipeline.schedule.stage_planner.ModelCosts``).

- F and B: each part's measured samples (``megatron.pipeline.part_timer``), their median (or mean) over every rank;
  a part timed only in a fused BW (1F1B) has it shared in the analytic B : W ratio;
- W and the activation memory per part: the stage profile's measured W and memory of each stage, shared among its
  parts in the proportions of the analytic cost model (``megatron.model.cost_model``) -- the deferred weight
  gradients of a stage run as one queue, which no hook splits by part;
- what an action holds besides its parts (the loss after the stage's output, the microbatch's tokens before the
  embedding, the autograd engine's start, the runtime's bookkeeping): each stage's measured F, B and W minus its
  parts' sum.  The stages that hold neither the embedding nor the head give the part every action pays
  (``overhead``, with the runtime's gap between actions); the first and the last stage's remainder beyond it goes
  to the embedding and the head, which travel with those stages.  The parts then add up to every measured stage;
  a fused-BW profile (1F1B) is calibrated on its BW alike (each part's B + W; the overhead is paid once per BW);
- the time per iteration outside the actions (the profile's ``boundary``: the optimizer step and the
  iteration-boundary work): every rank starts it at the pipeline's end (the tied-embedding gradient sum
  synchronises them), and its optimizer work is proportional to the parameters it holds, so it moves with the
  split.  Each rank's own optimizer work in the window (``PartTimer``'s ``step_ms``: the optimizer's
  ``last_step_ms``, on the CPU) is shared among the parts it holds by their parameter counts, a part's share the
  median over the ranks holding it (``step_share``); the model's fixed ``step`` is the measured boundary less the
  largest rank's share on the window's split, so that split gives back the measured boundary
  (``ModelCosts.step_time``).

Either way the window gives one layer's costs *without* recompute and each recompute option's costs besides
(``recompute`` of ``combine_parts``, per virtual stage the choice in force in the window), from the same
measurements.  Under an explicit recompute (``ModelCosts.fixed_recompute``: one option, every stage, its uniform
runs or its block kept) the part timer times the B of a layer that recomputed apart from one that kept its
activations (block: a stage's later layers); what the option adds to B is their difference, or where no layer ran
plain the option's analytic share of the measured layer forward, the plain B the recomputing one less that
(``_fixed_recompute``).  Under ``--recompute-granularity auto``:

- an option's extra B time: where a stage ran it in the window, that stage's measured B beyond its parts' (the
  layers' without recompute, the embedding's and the head's, whose B is taken in the analytic ratio to their
  measured F when their stage's B was not timed), per layer; else a forward of what it recomputes, the measured
  layer F times the option's share of the analytic layer forward (full: all of it; selective: the core attention's
  FLOPs share);
- what F keeps under each option: its analytic bytes times one calibration factor, the median over the stages of
  each stage's measured saved-tensor bytes over the analytic bytes *with the choice that stage ran* (so a window
  where some stages recompute calibrates the others' options too); after B the option holds what the layer without
  recompute holds (the deferred W's operands), so its ``mem_b`` is the layer's ``mem_f + mem_b`` minus its ``mem_f``;
- what B holds while it recomputes a layer under each option (``RecomputeOption.transient``): where a stage ran it,
  that stage's measured B transient less what the stage's other layers, runs and head add to it
  (``ModelCosts.transient_rest``), the median over those stages; else its analytic bytes times the calibration
  factor (both also under an explicit recompute);
- the stage totals the remainders are calibrated against (``_calibrate``) count each stage's layers with its own
  choice (a block's first layers recomputing, the rest plain), so the parts add up to every measured stage under
  the choice it ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from zb_pipeline.schedule.model_costs import ModelCosts, PartCosts, RecomputeOption, StepShare
from zb_pipeline.schedule.profile import Profile

PARTS = ("embedding", "layer", "head")


def step_shares(summaries: list[dict[str, Any]], summary: Callable[[list[float]], float]) -> StepShare | None:
    """Each part's share of the optimizer work (module docstring): every rank's measured work (``summary`` of its
    samples) shared among its parts by their parameter counts, per part the median over the ranks that hold it.
    None when a rank measured none (a GPU, a window of one iteration)."""
    per: dict[str, list[float]] = {part: [] for part in PARTS}
    for one in summaries:
        step = one.get("step") or {}
        if not step.get("ms"):
            return None
        n = int(step["layers"])
        total = step["embedding"] + n * step["layer"] + step["head"]
        if total <= 0:
            continue
        per_param = float(summary(step["ms"])) / total
        for part in per:
            if step[part] > 0 and (part != "layer" or n):
                per[part].append(per_param * step[part])
    return StepShare(**{part: float(statistics.median(v)) if v else 0.0 for part, v in per.items()})


def combine_parts(
    summaries: list[dict[str, dict[str, Any]]],
    profile: Profile,
    analytic: ModelCosts,
    *,
    statistic: str = "median",
    recompute: Sequence[str] = (),
) -> dict:
    """Every rank's ``local_summary`` and the stage profile into a ``parts`` entry (see the module docstring).

    Each part's F and B are the median (``statistic``: or the mean) of every rank's samples of it (a layer's: of
    all layers, which are alike).
    A stage's measured W (or, without one, its F) and memory scale the analytic parts it holds; each stage's
    remainder is calibrated in (``_calibrate``).  ``recompute``: each virtual stage's choice in the window (names
    of ``analytic.option_names()``; () = none everywhere); with options in ``analytic`` the entry gets them,
    measured (``_measured_options``).
    """
    summary = statistics.median if statistic == "median" else statistics.fmean
    measured: dict[str, dict[str, float]] = {}
    for part in PARTS:
        for kind in ("f", "b", "bw", "rb", "rbw"):
            values = [v for s in summaries for v in s.get(part, {}).get(kind, ())]
            if values:
                measured.setdefault(part, {})[kind] = float(summary(values))
    missing = [p for p in PARTS if "f" not in measured.get(p, {})]
    if missing:
        raise ValueError(f"the profiling window timed no {', '.join(missing)} forward: profile at least one iteration")
    layers = profile.stage_layers
    if len(layers) != profile.num_stages:
        raise ValueError("per-part costs need the profile's stage_layers (layers per virtual stage)")
    names = analytic.option_names()
    unknown = [c for c in recompute if c not in names]
    if unknown or (recompute and len(recompute) != profile.num_stages):
        raise ValueError(f"recompute choices {list(recompute)} are not one of {list(names)} per virtual stage")
    opts = [names.index(c) for c in recompute] if recompute else [0] * profile.num_stages
    # an explicit recompute (``analytic.fixed_recompute``, in force on every stage): the layers' B timed apart
    # by whether they recomputed give the layer without recompute and what the option adds
    fixed: dict[int, float] = {}
    if analytic.fixed_recompute:
        measured["layer"], fixed = _fixed_recompute(measured["layer"], analytic)
    if analytic.recompute and not {"b", "bw"} & set(measured["layer"]):
        raise ValueError("the profiling window timed no layer backward without recompute (every stage recomputes)")
    last = profile.num_stages - 1
    an = {"embedding": analytic.embedding, "layer": analytic.layer, "head": analytic.head}

    def held(s: int) -> dict[str, int]:
        return {"embedding": int(s == 0), "layer": layers[s], "head": int(s == last)}

    def scale(s: int, field: str, measured_total: float | None) -> float | None:
        """measured / analytic total of ``field`` on stage ``s``, its layers under the choice it ran."""
        q = analytic.stage_part(layers[s], opts[s], first=s == 0, last=s == last)
        total = getattr(q, field)
        if measured_total is None or total <= 0:
            return None
        return measured_total / total

    def share(part: str, field: str, per_stage: tuple) -> float:
        factors = [scale(s, field, per_stage[s]) for s in range(profile.num_stages) if held(s)[part]]
        factors = [f for f in factors if f is not None]
        if not factors or getattr(an[part], field) == 0:
            return 0.0
        return getattr(an[part], field) * float(statistics.median(factors))

    w_stage = tuple(profile.w) if all(v is not None for v in profile.w) else None
    parts: dict[str, dict[str, float]] = {}
    for part in PARTS:
        f = measured[part]["f"]
        b, bw = measured[part].get("b"), measured[part].get("bw")
        if b is None and bw is not None:  # fused BW only: its measured BW shared in the analytic B : W ratio
            b_share = an[part].b / (an[part].b + an[part].w) if an[part].b + an[part].w > 0 else 1.0
            b = bw * b_share
        elif b is None:  # B not timed (its stages recompute): the analytic ratio to the measured F
            b = an[part].b * (f / an[part].f) if an[part].f > 0 else 0.0
        if w_stage is not None:
            w = share(part, "w", w_stage)
        elif bw is not None and measured[part].get("b") is None:  # fused BW only: the rest of its measured BW
            w = bw - b
        else:  # fused BW only, not timed: W in the analytic ratio to the measured F
            w = an[part].w * (f / an[part].f) if an[part].f > 0 else 0.0
        parts[part] = {"f": f, "b": b, "w": w}
    _memory(parts, profile, analytic, opts)
    ran = fixed if analytic.fixed_recompute else _measured_recompute(parts, profile, held, opts)
    options = _measured_options(analytic, parts, ran, profile, opts)

    def cost(s: int, part: str, kind: str) -> float:
        """A part's time on stage ``s`` (a layer's: the mean over the stage's layers, block recomputing the first)."""
        if part != "layer" or kind != "b" or not opts[s] or not layers[s]:
            return parts[part][kind]
        o = options[opts[s] - 1]
        return parts[part][kind] + o.b_extra * o.recomputed(layers[s]) / layers[s]

    overhead = _calibrate(parts, profile, held, cost)
    out: dict[str, Any] = {
        "num_layers": analytic.num_layers,
        "comm": float(profile.comm or 0.0),
        "overhead": overhead,
        "step": float(profile.boundary),
    }
    shares = step_shares(summaries, summary)
    if shares is not None:  # the window's split gives back the measured boundary
        window = shares.largest_rank(layers, profile.stage_to_rank)
        out.update(step=max(float(profile.boundary) - window, 0.0), step_share=dataclasses.asdict(shares))
    for part, q in parts.items():
        out[part] = {**q, "f": max(q["f"], 1e-6), "b": max(q["b"], 0.0), "w": max(q["w"], 0.0)}
    if options:
        out["recompute"] = [dataclasses.asdict(o) for o in options]
    if analytic.fixed_recompute:
        out["fixed_recompute"] = True
    return out


def _memory(parts: dict[str, dict[str, float]], profile: Profile, analytic: ModelCosts, opts: list[int]) -> None:
    """Each part's ``mem_f`` and ``mem_b`` from the stages' measured memory (in place; module docstring): the layer
    and the embedding from the stages without the head (each stage's measured over analytic bytes under the choice
    it ran, their median), the head the last stage's remainder; what waits for W after B (``mem_f + mem_b``, the
    same under every choice) likewise."""
    S, layers = profile.num_stages, profile.stage_layers
    mem_b = tuple(profile.mem_b) if profile.mem_b else (0.0,) * S
    held = [f + b for f, b in zip(profile.mem_f, mem_b)]  # what waits for W after B
    a = analytic.layer
    body = [s for s in range(S) if s < S - 1 and layers[s]] or [S - 1]  # stages whose memory is layers (+ tokens)

    def analytic_total(s: int) -> float:
        """What F keeps on stage ``s`` by the analytic model, its layers under the choice it ran, the head left out
        (uniform runs keep one input per run, block recomputes the first layers: ``ModelCosts.stage_part``)."""
        return analytic.stage_part(layers[s], opts[s], first=s == 0, last=False).mem_f - analytic.overhead.mem_f

    totals = {s: analytic_total(s) for s in body}
    factors = [profile.mem_f[s] / t for s, t in totals.items() if t > 0]
    c = float(statistics.median(factors)) if factors else 1.0
    emb_f = analytic.embedding.mem_f * c
    layer_f = a.mem_f * c
    per_layer = [held[s] / layers[s] for s in body if layers[s]]  # the embedding holds nothing after B
    layer_held = max(float(statistics.median(per_layer)), 0.0) if per_layer else layer_f
    last = S - 1
    rest_f = profile.mem_f[last] - analytic_total(last) * c
    rest_held = held[last] - layers[last] * layer_held
    head_f = max(rest_f, 0.0)
    parts["embedding"].update(mem_f=emb_f, mem_b=-emb_f)  # its W reads the token ids, the microbatch's input
    parts["layer"].update(mem_f=layer_f, mem_b=max(layer_held, 0.0) - layer_f)
    parts["head"].update(mem_f=head_f, mem_b=max(rest_held, 0.0) - head_f)


def _fixed_recompute(layer: dict[str, float], analytic: ModelCosts) -> tuple[dict[str, float], dict[int, float]]:
    """Under an explicit recompute the part timer times a layer that recomputed (its B: recompute and backward,
    ``"rb"``; a fused BW: ``"rbw"``) apart from one that did not (block: a stage's later layers; ``"b"``/``"bw"``).
    What the option adds to a layer's B is their difference; where no layer ran without it (uniform, selective, a
    block over every layer of a stage), the layer without recompute is the recomputing one less the option's
    analytic share of the measured layer forward.  Returns the measured layer's times with that one in, and
    ``{1: the option's measured extra}`` (empty: no recomputing layer was timed)."""
    option, a = analytic.recompute[0], analytic.layer
    for plain, recomputing in (("b", "rb"), ("bw", "rbw")):
        if recomputing not in layer:
            continue
        if plain not in layer:
            guess = option.b_extra * (layer["f"] / a.f) if a.f > 0 else 0.0
            layer = {**layer, plain: max(layer[recomputing] - guess, 0.0)}
        return layer, {1: max(layer[recomputing] - layer[plain], 0.0)}
    return layer, {}


def _measured_recompute(
    parts: dict[str, dict[str, float]], profile: Profile, held: Callable[[int], dict[str, int]], opts: list[int]
) -> dict[int, float]:
    """What each recompute option that a stage ran in the window added to a layer's B, measured: the median over
    those stages of their measured B beyond their parts' (the layers' without recompute, the embedding's and the
    head's), per layer.  Empty without separate B times."""
    if any(v is None for v in profile.b):
        return {}
    extra: dict[int, list[float]] = {}
    for s, o in enumerate(opts):
        n = held(s)["layer"]
        if o and n:
            beyond = float(profile.b[s]) - sum(k * parts[p]["b"] for p, k in held(s).items())
            extra.setdefault(o, []).append(max(beyond, 0.0) / n)
    return {o: float(statistics.median(v)) for o, v in extra.items()}


def _measured_options(
    analytic: ModelCosts,
    parts: dict[str, dict[str, float]],
    ran: dict[int, float],
    profile: Profile,
    opts: list[int],
) -> tuple[RecomputeOption, ...]:
    """``analytic``'s recompute options under the window's measured layer (module docstring): B re-runs what
    the option recomputes -- measured where a stage ran it (``ran``: option index -> B time added per layer), else
    its share of the measured layer forward; F keeps the option's analytic bytes times the layer's calibration
    factor (its measured over analytic ``mem_f``); after B the option holds what the layer holds; while B
    recomputes, the transient measured where a stage ran it (``opts``: each stage's option), else the analytic one
    calibrated."""
    a, layer = analytic.layer, parts["layer"]
    time_scale = layer["f"] / a.f if a.f > 0 else 1.0
    mem_scale = layer["mem_f"] / a.mem_f if a.mem_f > 0 else 1.0
    held = layer["mem_f"] + layer["mem_b"]  # what waits for W after B, whatever the choice
    out = []
    for i, o in enumerate(analytic.recompute, start=1):
        keeps = o.mem_f * mem_scale
        b_extra = ran.get(i, o.b_extra * time_scale)
        # the option's memory, its runs or block kept (the transient to be measured)
        option = dataclasses.replace(o, b_extra=b_extra, mem_f=keeps, mem_b=held - keeps, transient=0.0)
        measured = _measured_transient(profile, opts, i, parts, option)
        transient = o.transient * mem_scale if measured is None else measured
        # a BW holds less (no W waits): the analytic difference, calibrated
        transient_bw = transient - (o.transient - o.transient_bw) * mem_scale
        out.append(dataclasses.replace(option, transient=transient, transient_bw=transient_bw))
    return tuple(out)


def _measured_transient(
    profile: Profile, opts: list[int], index: int, parts: dict[str, dict[str, float]], option: RecomputeOption
) -> float | None:
    """One layer's B transient under ``option`` (option ``index``) from the stages that ran it: each one's measured
    B transient less what its other layers, runs and head add (``ModelCosts.transient_rest`` under the measured
    parts' memory), their median (None: no stage ran it, or none measured one)."""
    measured = profile.mem_b_transient
    if not measured:
        return None
    memory = {p: PartCosts(0.0, 0.0, 0.0, mem_f=q["mem_f"], mem_b=q["mem_b"]) for p, q in parts.items()}
    model = ModelCosts(num_layers=max(sum(profile.stage_layers), 1), recompute=(option,), **memory)
    last = profile.num_stages - 1
    found = [
        measured[s] - model.transient_rest(n, 1, last=s == last)
        for s, (o, n) in enumerate(zip(opts, profile.stage_layers))
        if o == index and n and measured[s] > 0
    ]
    return float(statistics.median(found)) if found else None


def _calibrate(
    parts: dict[str, dict[str, float]],
    profile: Profile,
    held: Callable[[int], dict[str, int]],
    cost: Callable[[int, str, str], float],
) -> dict[str, float]:
    """Make the parts add up to each measured stage (see the module docstring): returns the per-action overhead
    and moves the first and the last stage's remainder into ``parts``' embedding and head (in place).  ``cost(s,
    part, kind)``: the part's time on stage ``s`` under the recompute choice it ran.  A fused-BW profile (no
    separate B and W) is calibrated on its BW, each part's ``b + w``: the remainder of the embedding and the head
    goes to their B and W in the ratio their BW was shared in, the per-action overhead to B alone (a BW is one
    action, paying it once)."""
    S = profile.num_stages
    gap = float(profile.overhead)
    fused = any(v is None for v in (*profile.b, *profile.w))
    overhead = {"f": _calibrate_kind(parts, profile.f, "f", S, held, cost) + gap}
    if fused and any(v is None for v in profile.bw):  # neither split nor fused times on every stage: not calibrated
        return {**overhead, "b": gap, "w": gap}
    if not fused:
        for kind, per_stage in (("b", profile.b), ("w", profile.w)):
            overhead[kind] = _calibrate_kind(parts, per_stage, kind, S, held, cost) + gap
        return overhead
    shares = {p: (q["b"], q["w"]) for p, q in parts.items()}  # each part's BW as shared before the remainder

    def bw(s: int, part: str, kind: str) -> float:
        return cost(s, part, "b") + cost(s, part, "w")

    def add(part: str, rest: float) -> None:
        b, w = shares[part]
        b_share = b / (b + w) if b + w > 0 else 1.0
        parts[part]["b"] += rest * b_share
        parts[part]["w"] += rest * (1.0 - b_share)

    overhead["b"] = _calibrate_kind(parts, profile.bw, "bw", S, held, bw, add=add) + gap
    overhead["w"] = 0.0
    return overhead


def _calibrate_kind(
    parts: dict[str, dict[str, float]],
    per_stage: Sequence[float | None],
    kind: str,
    num_stages: int,
    held: Callable[[int], dict[str, int]],
    cost: Callable[[int, str, str], float],
    *,
    add: Callable[[str, float], None] | None = None,
) -> float:
    """One kind's calibration (``_calibrate``): each stage's measured ``per_stage`` time less its parts'; the
    median over the stages without embedding and head (at least 0) is what every action pays beyond its parts
    (returned), the first and the last stage's rest beyond it goes to the embedding and the head (``add(part,
    time)``; default: onto ``parts[part][kind]``)."""

    def rest(s: int) -> float:
        return float(per_stage[s]) - sum(n * cost(s, p, kind) for p, n in held(s).items())

    def onto(part: str, time: float) -> None:
        parts[part][kind] += time

    add = onto if add is None else add
    middle = [rest(s) for s in range(num_stages) if not held(s)["embedding"] and not held(s)["head"]]
    every = max(0.0, statistics.median(middle)) if middle else 0.0
    rest0, rest_last = rest(0), rest(num_stages - 1)  # both before either moves
    add("embedding", rest0 - every)
    if num_stages > 1:
        add("head", rest_last - every)
    return every
