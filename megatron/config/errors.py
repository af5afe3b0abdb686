"""The one error type for bad user input to the trainer.

Every check that a user can trigger with a flag, a YAML file or a launch layout raises ``ConfigError`` with a single
line naming the problem and the fix. ``pretrain_gpt.py`` turns it into one line on rank 0 and exit code 2 on every rank.
It subclasses ``ValueError`` so library callers can catch it as the project's usual input error.
"""


class ConfigError(ValueError):
    """Bad input: the message is one line saying what is wrong and how to fix it."""


def require(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


class RunAbortedError(RuntimeError):
    """The run stopped for a reason outside its input (disk full during a save, NaN with
    ``--check-for-nan-in-loss-and-grad``): the message is one line naming what happened and what to do."""
