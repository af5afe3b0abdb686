"""The communication layer: every collective and point-to-point call of ``megatron/`` and ``zb_pipeline/``.

Nothing else in either package touches ``torch.distributed`` (``tests/test_comm_layer.py`` checks the source); the
test harness (``zb_pipeline.testing``) and ``tools/`` may.  The layer knows each group's device from its backend
(CUDA for NCCL, CPU for gloo) and keeps tensors and groups matched, so a CPU tensor never meets an NCCL group.

One concept per file:

- ``backend``: the ``torch.distributed`` underneath (tests can put a checking wrapper or a fake there: ``use``);
- ``placement``: a group's backend and device, the device check, ``pretend`` for tests;
- ``groups``: joining the default group (NCCL with asynchronous error handling), subgroups, sizes and ranks;
- ``collectives``: all-reduce/gather/reduce-scatter, host numbers reduced on the device, object collectives,
  barrier -- and which calls refuse a tensor on the wrong device (all of them that take one) versus stage host
  numbers on the right one (``all_reduce_values``);
- ``failures``: ``PeerFailedError``, the one error of every call when a peer died or stopped (the call, the group, the
  ranks waited for, timeout or closed connection);
- ``point_to_point``: sends, receives, their batches, and ``wait`` (a host timeout on gloo; on NCCL no per-call
  timeout, so a wait only makes the compute stream wait and the process group's watchdog times a transfer out);
  ``P2PLink``, the same over one group resolved once, calling the process group's own ``send``/``recv``.

Use it as ``from zb_pipeline import comm`` and ``comm.all_reduce(t, group=g)``.
"""

from zb_pipeline.comm.backend import DistError, ProcessGroup, use
from zb_pipeline.comm.collectives import (
    REDUCE_OPS,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_reduce_values,
    barrier,
    broadcast_object_list,
    reduce_scatter_tensor,
)
from zb_pipeline.comm.failures import PeerFailedError, group_name, is_peer_error, peer_failure
from zb_pipeline.comm.groups import (
    backend_name,
    destroy,
    group_ranks,
    init_process_group,
    is_initialized,
    new_group,
    rank,
    world_size,
)
from zb_pipeline.comm.placement import CommDeviceError, GroupPlacement, check_devices, device_of, placement, pretend
from zb_pipeline.comm.point_to_point import P2PLink, batch_isend_irecv, irecv, isend, recv, send, wait

__all__ = [
    "REDUCE_OPS",
    "CommDeviceError",
    "DistError",
    "GroupPlacement",
    "P2PLink",
    "PeerFailedError",
    "ProcessGroup",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_values",
    "backend_name",
    "barrier",
    "batch_isend_irecv",
    "broadcast_object_list",
    "check_devices",
    "destroy",
    "device_of",
    "group_name",
    "group_ranks",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_peer_error",
    "isend",
    "new_group",
    "peer_failure",
    "placement",
    "pretend",
    "rank",
    "recv",
    "reduce_scatter_tensor",
    "send",
    "use",
    "wait",
    "world_size",
]
