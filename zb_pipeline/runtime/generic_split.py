"""A B/W split for any ``nn.Module`` stage through autograd: input gradients first, weight gradients later.

Users' own stages do not use ``deferrable_linear``; they still get a split, without a second full backward:

1. Before B, walk the autograd graph from the stage outputs and mark, for every node, whether it leads to a stage
   input and whether it leads to a (non-deferrable) parameter.
2. *Boundary* nodes lead to an input and also have an edge that leads only to parameters (a matmul whose second
   operand is a weight, an add of a bias, a layer norm with affine weights).  A pre-hook on each boundary node
   records the gradient flowing into it during B.
3. B is ``torch.autograd.grad(outputs, inputs, retain_graph=True)``: the engine computes only what the inputs need
   (e.g. ``grad_y @ W`` of a matmul, not ``grad_y^T @ x``).
4. W is ``torch.autograd.grad(boundary edges, params, recorded gradients)``: the engine re-enters the graph at the
   boundary nodes and computes only what the parameters need.  Nothing on the input path is recomputed, unlike a
   naive second pass from the outputs.

Outputs that do not depend on any input (e.g. the first stage, whose input is token ids) are boundaries themselves,
so their whole backward is W.  Parameters tagged ``zb_deferrable`` (owned by deferrable layers) are left to those
layers, which must be bound to the same store (``GenericSplit`` binds them).

Memory: B keeps the graph (``retain_graph``) until W, as a zero-bubble schedule's W needs the activations anyway;
W releases it.  Gradients are accumulated into ``param.main_grad`` when present, else ``param.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from zb_pipeline.runtime.deferrable_linear import accumulate_grad
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store


def _next_nodes(node) -> list:
    return [nxt for nxt, _ in node.next_functions if nxt is not None]


def _classify(
    roots: list, input_nodes: set[int], param_nodes: set[int]
) -> tuple[dict[int, bool], dict[int, bool], dict[int, object]]:
    """Post-order walk: for every node id, does it lead to an input node, does it lead to a parameter node."""
    to_input: dict[int, bool] = {}
    to_param: dict[int, bool] = {}
    nodes: dict[int, object] = {}
    stack: list[tuple[object, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if key in to_input and not expanded:
            continue
        if not expanded:
            nodes[key] = node
            to_input[key] = False  # provisional: marks "visited" (the autograd graph is acyclic)
            stack.append((node, True))
            stack.extend((n, False) for n in _next_nodes(node) if id(n) not in to_input)
            continue
        nexts = _next_nodes(node)
        to_input[key] = key in input_nodes or any(to_input[id(n)] for n in nexts)
        to_param[key] = key in param_nodes or any(to_param[id(n)] for n in nexts)
    return to_input, to_param, nodes


class _Entry:
    """One place where W re-enters the graph: a boundary node (or a root output) with the gradients it received."""

    __slots__ = ("node", "grads", "starts")

    def __init__(self, node, grads: dict[int, torch.Tensor], starts: list) -> None:
        self.node, self.grads, self.starts = node, grads, starts

    def edges(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        nrs = sorted(self.grads)
        return [GradientEdge(self.node, nr) for nr in nrs], [self.grads[nr] for nr in nrs]


class _WeightWork:
    """The recorded boundary gradients of one B, turned into parameter gradients at W.

    Each group of entries whose parameter-only subgraphs ("zones") are disjoint from the others' gets its own engine
    call, so the engine never walks from one boundary down the input path into another (that would count the lower
    boundary's gradient twice and redo input-gradient work).  Entries whose zones overlap (a parameter used in two
    places) share a call; there a pre-hook pins every boundary's incoming gradient to the recorded one.
    """

    def __init__(self, groups: list[tuple[list[_Entry], list[torch.nn.Parameter]]]) -> None:
        self.groups = groups

    def __call__(self) -> None:
        groups, self.groups = self.groups, []  # release the graph afterwards
        with torch.enable_grad():
            for entries, params in groups:
                edges: list[GradientEdge] = []
                grads: list[torch.Tensor] = []
                for entry in entries:
                    e, g = entry.edges()
                    edges += e
                    grads += g
                handles = [e.node.register_prehook(_pin(e.grads)) for e in entries] if len(entries) > 1 else []
                try:
                    param_grads = torch.autograd.grad(edges, params, grads, allow_unused=True)
                finally:
                    for h in handles:
                        h.remove()
                for param, grad in zip(params, param_grads):
                    if grad is not None:
                        accumulate_grad(param, grad)


def _pin(recorded: dict[int, torch.Tensor]):
    def hook(grad_outputs: tuple) -> tuple:
        return tuple(recorded.get(i, g) for i, g in enumerate(grad_outputs))

    return hook


def _group_entries(
    entries: list[_Entry], to_input: dict[int, bool], to_param: dict[int, bool], param_of: dict[int, torch.nn.Parameter]
) -> list[tuple[list[_Entry], list[torch.nn.Parameter]]]:
    """Union entries whose zones (parameter-only nodes reachable from their start nodes) share a node."""
    owner: dict[int, int] = {}  # node id -> entry index that first reached it
    parent = list(range(len(entries)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    zones: list[list[int]] = []
    for idx, entry in enumerate(entries):
        zone: list[int] = []
        stack = list(entry.starts)
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            key = id(node)
            if key in seen:
                continue
            seen.add(key)
            zone.append(key)
            if key in owner:
                a, b = find(owner[key]), find(idx)
                if a != b:
                    parent[b] = a
            else:
                owner[key] = idx
            stack.extend(n for n in _next_nodes(node) if to_param.get(id(n)) and not to_input.get(id(n)))
        zones.append(zone)
    grouped: dict[int, tuple[list[_Entry], list[torch.nn.Parameter]]] = {}
    for idx, entry in enumerate(entries):
        group_entries, params = grouped.setdefault(find(idx), ([], []))
        group_entries.append(entry)
        params += [param_of[k] for k in zones[idx] if k in param_of]
    return [(e, list({id(p): p for p in ps}.values())) for e, ps in grouped.values() if ps]


def split_backward(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    store: WeightGradStore | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Compute the input gradients now; enqueue the parameter gradients in ``store`` (or run them now when the store
    is absent or not deferring).  Returns one gradient (or None) per input."""
    if len(outputs) != len(grad_outputs):
        raise ValueError(f"got {len(outputs)} outputs but {len(grad_outputs)} output gradients")
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    grad_inputs: list[torch.Tensor | None] = [None] * len(inputs)
    if not pairs:
        return tuple(grad_inputs)
    root_edges = [get_gradient_edge(o) for o, _ in pairs]
    diff_inputs = [i for i, x in enumerate(inputs) if x.requires_grad]
    input_nodes = {id(get_gradient_edge(inputs[i]).node) for i in diff_inputs}
    params = [p for p in params if p.requires_grad and not getattr(p, "zb_deferrable", False)]
    param_nodes = {id(get_gradient_edge(p).node) for p in params}

    to_input, to_param, nodes = _classify([e.node for e in root_edges], input_nodes, param_nodes)
    boundary = [
        node
        for key, node in nodes.items()
        if to_input[key]
        and key not in input_nodes
        and any(not to_input[id(n)] and to_param[id(n)] for n in _next_nodes(node))
    ]
    # Roots that lead to parameters but no input: their gradient is known already; all of their backward is W.
    entries: list[_Entry] = []
    for edge, (out, grad) in zip(root_edges, pairs):
        if not to_input[id(edge.node)] and to_param[id(edge.node)]:
            g = torch.ones_like(out) if grad is None else grad
            entries.append(_Entry(edge.node, {edge.output_nr: g}, [edge.node]))

    recorded: dict[int, tuple] = {}
    handles = [node.register_prehook(_recorder(recorded, id(node))) for node in boundary]
    try:
        b_pairs = [(o, g) for (o, g), e in zip(pairs, root_edges) if to_input[id(e.node)]]
        if b_pairs and diff_inputs:
            got = torch.autograd.grad(
                [o for o, _ in b_pairs],
                [inputs[i] for i in diff_inputs],
                [g for _, g in b_pairs],
                retain_graph=bool(boundary),
                allow_unused=True,
            )
            for i, g in zip(diff_inputs, got):
                grad_inputs[i] = g
    finally:
        for h in handles:
            h.remove()
    for node in boundary:
        grads = {nr: g for nr, g in enumerate(recorded.get(id(node), ())) if g is not None}
        if grads:
            starts = [n for n in _next_nodes(node) if not to_input[id(n)] and to_param[id(n)]]
            entries.append(_Entry(node, grads, starts))

    param_of = {id(get_gradient_edge(p).node): p for p in params}
    work = _WeightWork(_group_entries(entries, to_input, to_param, param_of))
    if store is None:
        work()
    else:
        store.submit(work)
    return tuple(grad_inputs)


def _recorder(recorded: dict[int, tuple], key: int):
    def hook(grad_outputs: tuple) -> None:
        recorded[key] = tuple(grad_outputs)

    return hook


class GenericSplit:
    """The generic B/W split bound to one stage module and one store.

    ``backward_input(outputs, grad_outputs, inputs)`` is B: call it inside ``store.defer(chunk, mb)``; the W work
    (the module's own parameters through autograd, plus its deferrable layers' closures) lands in the store.
    """

    def __init__(self, module: torch.nn.Module, store: WeightGradStore | None) -> None:
        self.module = module
        self.store = store
        bind_weight_grad_store(module, store)
        self.params = [p for p in module.parameters() if p.requires_grad]

    def backward_input(
        self,
        outputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor | None, ...]:
        store = self.store
        if store is None:
            return split_backward(outputs, grad_outputs, inputs, self.params, store)
        store.split_autograd_params = True
        try:
            return split_backward(outputs, grad_outputs, inputs, self.params, store)
        finally:
            store.split_autograd_params = False
