"""Device discipline checks for tests: what would break on a GPU machine, found on CPU.

Two instruments, used together around training iterations (``tests/test_comm_layer.py``):

- ``DeviceCheckingBackend`` wraps ``torch.distributed`` underneath the communication layer
  (``with comm.use(DeviceCheckingBackend(dist)):``) and asserts, for every call that carries a tensor, that the
  tensor is on the device of the group it goes over -- as the layer resolves it (``comm.placement``, so
  ``comm.pretend`` moves the goalposts too) -- and, if given, on the expected device (the ``ParallelContext``'s).
  On gloo every device is the CPU, so the check is what a GPU run would enforce: a tensor created without the
  context's device (a CPU tensor on an NCCL group) fails here exactly where NCCL would refuse it.
- ``ExplicitDeviceMode`` records every tensor factory call (``torch.zeros``, ``torch.tensor``, ...) made *from our
  own modules* without an explicit ``device=``: such a tensor lands on the CPU whatever device the run uses.  It also
  records every host read (``.item()``, ``.tolist()``, ``float(t)``, ``.cpu()``, ...) from our modules, each a host
  synchronisation on a GPU, so a test can bound them.  Forward and backward alike (see the class for why it is not
  a ``TorchFunctionMode``).

"Our modules" are source files under the given package directories, excluding this test harness.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zb_pipeline import comm
from zb_pipeline.comm.backend import COLLECTIVE_CALLS, direct_group_of

__all__ = ["DeviceCheckingBackend", "ExplicitDeviceMode", "HostRead", "package_dirs"]

# torch.distributed functions whose tensor arguments the wrapper checks (the rest pass straight through).
_TENSOR_CALLS = COLLECTIVE_CALLS | {"all_to_all_single", "isend", "irecv", "send", "recv"}


class DeviceCheckingBackend:
    """``torch.distributed`` with a device assertion in front of every tensor-carrying call (module docstring).

    ``calls`` counts the checked calls by ``(name, backend)``; ``tensors`` counts the tensors checked.
    """

    def __init__(self, real: Any, *, expected_device: torch.device | str | None = None) -> None:
        self._real = real
        self.expected_device = torch.device(expected_device) if expected_device is not None else None
        self.calls: Counter[tuple[str, str]] = Counter()
        self.tensors = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name in _TENSOR_CALLS:
            return functools.partial(self._checked, name, attr)
        return attr

    def _checked(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        self.check(name, tensors, kwargs.get("group"))
        return fn(*args, **kwargs)

    def P2POp(self, op: Any, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> Any:  # noqa: N802
        """torch's ``P2POp`` over the real ``isend``/``irecv`` (torch checks the function's identity)."""
        real_op = op.args[1] if isinstance(op, functools.partial) else op
        return self._real.P2POp(real_op, tensor, peer, group=group, tag=tag)

    def batch_isend_irecv(self, ops: Sequence[Any]) -> Any:
        for op in ops:
            self.check("batch_isend_irecv", [op.tensor], op.group)
        return self._real.batch_isend_irecv(list(ops))

    def direct_group(self, group: Any = None) -> Any:
        """The process group a ``comm.P2PLink`` calls directly, behind the same check (as ``isend``/``irecv``)."""
        real = direct_group_of(self._real, group)
        return None if real is None else _CheckedGroup(self, real, group)

    def check(self, name: str, tensors: Iterable[torch.Tensor], group: Any) -> None:
        where = comm.placement(group)
        for t in tensors:
            self.tensors += 1
            if not where.accepts(t.device):
                raise AssertionError(
                    f"{name}: a {tuple(t.shape)} {t.dtype} tensor on {t.device} reached a {where.backend} group "
                    f"whose device is {where.device}"
                )
            if self.expected_device is not None and t.device != self.expected_device:
                raise AssertionError(
                    f"{name}: a tensor on {t.device}, but the run's device is {self.expected_device} "
                    f"({where.backend} group)"
                )
        self.calls[(name, where.backend)] += 1


class _CheckedGroup:
    """A process group whose ``send``/``recv`` are checked like ``isend``/``irecv`` (``direct_group``)."""

    def __init__(self, owner: DeviceCheckingBackend, real: Any, group: Any) -> None:
        self._owner, self._real, self._group = owner, real, group

    def send(self, tensors: list[torch.Tensor], group_peer: int, tag: int) -> Any:
        self._owner.check("isend", tensors, self._group)
        return self._real.send(tensors, group_peer, tag)

    def recv(self, tensors: list[torch.Tensor], group_peer: int, tag: int) -> Any:
        self._owner.check("irecv", tensors, self._group)
        return self._real.recv(tensors, group_peer, tag)


# torch functions that create a tensor and take ``device=``.
FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "range",
    "linspace",
    "logspace",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
    "empty_strided",
    "scalar_tensor",
)
# Tensor methods that read device data into host memory (each a synchronisation on a GPU).
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")

_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass(frozen=True)
class HostRead:
    """One host read from our code: the tensor method, where it was called, and the current ``tag``."""

    name: str
    file: str
    line: int
    function: str
    tag: Any


def package_dirs(*modules: Any) -> tuple[str, ...]:
    """The source directories of the given packages (``package_dirs(megatron, zb_pipeline)``)."""
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in modules)


class ExplicitDeviceMode:
    """Inside ``with``: records factory calls without ``device=`` and host reads made from the modules under ``roots``.

    ``violations``: ``"file:line function: torch.zeros without device="`` strings; ``reads``: ``HostRead``s, each
    tagged with ``tag`` at the time (set it to the iteration, say).  The harness itself (``zb_pipeline.testing``)
    is never "ours"; a call counts when its immediate caller is ours (torch's own factory calls do not).

    An equivalent of a ``TorchFunctionMode``, not one: the autograd engine runs backward functions with the Python
    torch-function modes switched off, so a mode never sees the backward of our ``autograd.Function``s (the
    tensor-parallel collectives, the deferrable linears, the cross-entropy).  This one swaps ``torch.<factory>`` and
    the ``Tensor`` read methods for recording wrappers while it is active, which every caller and thread sees.
    """

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)
        self.violations: list[str] = []
        self.reads: list[HostRead] = []
        self.tag: Any = None
        self._restore: list[tuple[Any, str, Any]] = []

    def _ours(self, filename: str) -> bool:
        path = os.path.abspath(filename)
        return path.startswith(self.roots) and not path.startswith(_HARNESS_DIR)

    def __enter__(self) -> ExplicitDeviceMode:
        if self._restore:
            raise RuntimeError("ExplicitDeviceMode is already active")
        for name in FACTORIES:
            if hasattr(torch, name):
                self._swap(torch, name, self._factory(name, getattr(torch, name)))
        for name in HOST_READS:
            self._swap(torch.Tensor, name, self._read(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._restore:
            owner, name, original = self._restore.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def _swap(self, owner: Any, name: str, wrapper: Any) -> None:
        own = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)
        self._restore.append((owner, name, own))
        setattr(owner, name, wrapper)

    def _factory(self, name: str, real: Any) -> Any:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is None and not (
                name == "as_tensor" and args and isinstance(args[0], torch.Tensor)
            ):
                frame = sys._getframe(1)
                if self._ours(frame.f_code.co_filename):
                    self.violations.append(f"{_where(frame)}: torch.{name} without device=")
            return real(*args, **kwargs)

        return functools.wraps(real)(factory)

    def _read(self, name: str, real: Any) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if self._ours(frame.f_code.co_filename):
                code = frame.f_code
                self.reads.append(HostRead(name, code.co_filename, frame.f_lineno, code.co_name, self.tag))
            return real(*args, **kwargs)

        return functools.wraps(real)(read)


_INHERITED = object()


def _where(frame: Any) -> str:
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
