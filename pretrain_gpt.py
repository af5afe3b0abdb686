"""Pretrain a GPT model with Megatron-LM's flags: ``torchrun --nproc-per-node N pretrain_gpt.py --num-layers ...``.

Bad input (a flag, a value, a layout that does not fit the world size) makes rank 0 print one line naming the
problem and the fix; every rank exits with code 2 before any collective, so nothing hangs and there is no traceback.
A rank that dies or stops mid-run makes every surviving rank print one line naming itself, the call, the group and
the rank it waited for, and exit with code 3 (``megatron.peer_failure``).  ``ZB_DEBUG=1`` adds the tracebacks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)

    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError, RunAbortedError
    from megatron.peer_failure import EXIT_PEER_FAILURE, PeerFailedRunError
    from megatron.requirements import check_torch

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_torch(torch.__version__)
        run = parse_run_config(argv, world_size=world_size)
    except ConfigError as err:
        _traceback_if_debug()
        if rank == 0:
            print(f"pretrain_gpt.py: error: {err}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        for line in run.ignored_flag_warnings():
            print(line, file=sys.stderr, flush=True)

    from megatron.training import pretrain

    try:
        pretrain(run)
    except ConfigError as err:  # bad input found while building data, tokenizer or model: same on every rank
        _traceback_if_debug()
        if rank == 0:
            print(f"pretrain_gpt.py: error: {err}", file=sys.stderr, flush=True)
        return 2
    except RunAbortedError as err:  # disk full during a save, NaN with --check-for-nan-in-loss-and-grad
        _traceback_if_debug()
        if rank == 0:
            print(f"pretrain_gpt.py: stopped: {err}", file=sys.stderr, flush=True)
        return 1
    except PeerFailedRunError as err:  # another rank died or stopped: every surviving rank names whom it waited for
        _traceback_if_debug()
        print(f"pretrain_gpt.py: {err}", file=sys.stderr, flush=True)
        return EXIT_PEER_FAILURE
    return 0


def _traceback_if_debug() -> None:
    """With ``ZB_DEBUG=1``: the traceback of the error being handled, before its one line."""
    from megatron.peer_failure import debug_tracebacks

    if debug_tracebacks():
        import traceback

        traceback.print_exc(file=sys.stderr)


if __name__ == "__main__":
    code = main()
    from megatron.peer_failure import EXIT_PEER_FAILURE

    if code == EXIT_PEER_FAILURE:
        # Transfers still posted to the failed peer would keep this process alive until they time out; leaving at
        # once closes its connections, so the ranks waiting on this one fail at once instead of timing out too.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
