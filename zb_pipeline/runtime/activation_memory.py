"""Activation-memory accounting for the profiler: what each F, B and W adds to or frees from a rank's memory.

Two sources, chosen per run:

- ``"cuda"``: the change of ``torch.cuda.memory_allocated`` across the action, and the iteration's peak from the
  allocator's peak statistics (relative to what was allocated when the iteration began);
- ``"saved-tensors"`` (CPU): the bytes of the distinct storages a microbatch keeps alive, namely the tensors
  autograd has saved in the graph F built (read from the graph, parameters excluded, for as long as autograd keeps
  them) plus the tensors held by the deferred weight-gradient work B enqueued, until W runs it.  The rank's resident
  bytes after every action are summed; their maximum is the iteration's peak.  With activation recomputation a B
  also holds, while it runs, the graph it rebuilds for one segment: at each recompute (``WeightGradStore.
  on_recompute``) the rank's live storages plus that graph's are counted, and the B's *transient* is the most of
  that above the rank's sum before the B (``transient``; it enters the peak too).

``"none"`` records nothing (an iteration's peak is then 0).  ``ActivationMemory`` holds the samples;
``ActionProfiler`` (``zb_pipeline.runtime.profiler``) tells it when iterations and actions begin and end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from zb_pipeline.schedule.ir import Kind

__all__ = [
    "MEMORY_SOURCES",
    "ActivationMemory",
    "graph_saved_tensors",
    "resolve_memory_source",
    "storage_key",
    "tensors_in",
]

MEMORY_SOURCES = ("cuda", "saved-tensors", "none")
_FREES = (Kind.W, Kind.BW)  # the actions after which a microbatch holds nothing more of its own


def resolve_memory_source(memory: str, *, on_cuda: bool) -> str:
    """``"auto"`` -> CUDA statistics when the stages live on a GPU, saved-tensor bytes otherwise; checks the rest."""
    if memory == "auto":
        memory = "cuda" if on_cuda else "saved-tensors"
    if memory not in MEMORY_SOURCES:
        raise ValueError(f"{memory=} must be one of auto, cuda, saved-tensors, none")
    return memory


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """``(data pointer, bytes)`` of the storage under ``t``: views of one storage share the key."""
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def tensors_in(obj: Any, out: list, depth: int = 4, _seen: set | None = None) -> None:
    """Tensors reachable from ``obj`` through closures, containers and plain attributes (bounded depth)."""
    seen = set() if _seen is None else _seen
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, torch.nn.Module):
        return
    elif callable(obj) and getattr(obj, "__closure__", None):
        items = [cell.cell_contents for cell in obj.__closure__ if cell.cell_contents is not None]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).values()
    else:
        return
    for item in items:
        tensors_in(item, out, depth - 1, seen)


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def graph_saved_tensors(root: Any, out: list) -> None:
    """The tensors autograd has saved in the graph behind ``root`` (a tensor or a gradient edge), while it lives.

    Reads every node's ``_saved_*`` attributes (built-in ops) and ``saved_tensors`` (custom functions); a node
    whose buffers were freed by backward contributes nothing.  ``saved_tensors_hooks`` would see the same tensors
    as F runs, but autograd re-wraps what a hook returns, so a custom function that accumulates into the object it
    saved (a deferrable linear's weight) would lose its parameter: reading the graph changes nothing.
    """
    node = root.grad_fn if isinstance(root, torch.Tensor) else getattr(root, "node", None)
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        names = _SAVED_NAMES.get(type(n))
        if names is None:
            names = tuple(a for a in dir(n) if a.startswith("_saved_") or a == "saved_tensors")
            _SAVED_NAMES[type(n)] = names
        for name in names:
            try:
                v = getattr(n, name)
            except RuntimeError:  # freed by backward
                continue
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (tuple, list)):
                out.extend(t for t in v if isinstance(t, torch.Tensor))
        stack.extend(nxt for nxt, _ in n.next_functions)


class ActivationMemory:
    """One rank's activation-memory samples: per ``(kind, stage)`` deltas, per-stage residuals, per-iteration peaks.

    ``source`` is one of ``MEMORY_SOURCES``; ``param_ptrs`` are the storages of the stages' parameters (never
    counted as activations); ``device`` is where the CUDA statistics are read.
    """

    def __init__(self, source: str, *, device: str, param_ptrs: set[int]) -> None:
        if source not in MEMORY_SOURCES:
            raise ValueError(f"{source=} must be one of {MEMORY_SOURCES}")
        self.source = source
        self.device = device
        self.param_ptrs = param_ptrs
        self.mem: dict[tuple[Kind, int], list[float]] = {}  # (kind, stage) -> bytes added by each action
        self.residual: dict[int, list[float]] = {}  # stage -> bytes a microbatch still held after its W
        # (B or BW, stage) -> bytes it held above the sum before it (recompute)
        self.transient: dict[tuple[Kind, int], list[float]] = {}
        self.peaks: list[float] = []  # one per profiled iteration
        self._roots: dict[tuple[int, int], Any] = {}  # key -> what F saved for backward (autograd edge/tensor)
        self._work: dict[tuple[int, int], list[Callable[[], None]]] = {}  # key -> deferred W work objects
        self._live: dict[tuple[int, int], float] = {}  # key -> resident bytes
        self._peak = 0.0
        self._cuda_base = 0
        self._iteration_open = False
        self._in_b: tuple[int, int] | None = None  # the B (or BW) running now (saved-tensor source)
        self._b_kind = Kind.B
        self._b_high = 0.0  # the most the rank held during it

    @property
    def saved_tensors(self) -> bool:
        return self.source == "saved-tensors"

    @property
    def held_work(self) -> Mapping[tuple[int, int], list[Callable[[], None]]]:
        """Microbatch -> the deferred weight-gradient work still held (until its W runs)."""
        return self._work

    # -- iterations -------------------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """A profiled iteration starts: nothing is resident yet."""
        self._live.clear()
        self._peak = 0.0
        if self.source == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        self._iteration_open = True

    def close_iteration(self) -> None:
        """Record the open iteration's peak (no-op when none is open)."""
        if not self._iteration_open:
            return
        self._iteration_open = False
        if self.source == "cuda":
            self._peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        self.peaks.append(self._peak)

    # -- actions ----------------------------------------------------------------------------------------------
    def before_action(self, kind: Kind | None = None, key: tuple[int, int] | None = None) -> int:
        """What ``after_action`` needs from before the action: the allocated bytes (CUDA), else 0."""
        if self.source == "cuda":
            return torch.cuda.memory_allocated(self.device)
        if self.source == "saved-tensors" and kind in (Kind.B, Kind.BW):
            self._in_b, self._b_high, self._b_kind = key, 0.0, kind
        return 0

    def recomputed(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """B has rebuilt a segment's graph behind ``outputs``: count the rank's live bytes with it."""
        key = self._in_b
        if key is None or not self.saved_tensors:
            return
        found: list = []
        for out in outputs:
            graph_saved_tensors(out, found)
        storages = self._storages(key)
        for t in found:
            ptr, nbytes = storage_key(t)
            if ptr not in self.param_ptrs and nbytes > 0:
                storages[ptr] = nbytes
        held = sum(v for k, v in self._live.items() if k != key) + float(sum(storages.values()))
        self._b_high = max(self._b_high, held)

    def after_action(self, kind: Kind, key: tuple[int, int], before: int) -> list[Any]:
        """Record what action ``kind`` on microbatch ``key = (stage, microbatch)`` added (``before`` from
        ``before_action``).  Returns what this accounting held of the microbatch and lets go after its W (its
        graph's root, its W work): without the profiler those die inside the W, so the caller drops them where
        it times the action (``ActionProfiler``)."""
        if self.source == "cuda":
            self.mem.setdefault((kind, key[0]), []).append(float(torch.cuda.memory_allocated(self.device) - before))
        elif self.source == "saved-tensors":
            return self._account(kind, key)
        return []

    def hold_root(self, key: tuple[int, int], root: Any) -> None:
        """F of microbatch ``key`` saved ``root`` (a tensor or gradient edge) for its backward."""
        self._roots[key] = root

    def hold_work(self, key: tuple[int, int], work: Callable[[], None]) -> None:
        """B of microbatch ``key`` enqueued deferred weight-gradient ``work`` (it holds tensors until W runs it)."""
        self._work.setdefault(key, []).append(work)

    def resident(self, key: tuple[int, int]) -> float:
        """Bytes of the distinct live storages microbatch ``key`` holds: saved in F, or held by its W work."""
        return float(sum(self._storages(key).values()))

    def _storages(self, key: tuple[int, int]) -> dict[int, int]:
        storages: dict[int, int] = {}
        found: list = []
        root = self._roots.get(key)
        if root is not None:
            graph_saved_tensors(root, found)
        for work in self._work.get(key, ()):
            tensors_in(work, found)
        for t in found:
            ptr, nbytes = storage_key(t)
            if ptr not in self.param_ptrs and nbytes > 0:
                storages[ptr] = nbytes
        return storages

    def _account(self, kind: Kind, key: tuple[int, int]) -> list[Any]:
        released: list[Any] = []
        if self._in_b is not None:
            before = sum(self._live.values())
            self.transient.setdefault((self._b_kind, key[0]), []).append(max(0.0, self._b_high - before))
            self._peak = max(self._peak, self._b_high)
            self._in_b = None
        if kind in _FREES:
            released.append(self._work.pop(key, None))
        live = self.resident(key)
        prev = self._live.get(key, 0.0)
        self.mem.setdefault((kind, key[0]), []).append(live - prev)
        if kind in _FREES:
            self.residual.setdefault(key[0], []).append(live)
            released.append(self._roots.pop(key, None))
            self._live.pop(key, None)
        else:
            self._live[key] = live
        total = sum(self._live.values())
        if total > self._peak:
            self._peak = total
        return released
