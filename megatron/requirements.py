"""The torch this code needs, checked once at start-up with one line naming the fix.

``MIN_TORCH`` is what the model uses: ``scaled_dot_product_attention(enable_gqa=...)`` (2.5) and
``torch.nn.functional.rms_norm`` (2.4).  ``pyproject.toml`` states the same floor (a test keeps them equal).
"""

from __future__ import annotations

import re

from megatron.config.errors import ConfigError

MIN_TORCH: tuple[int, int] = (2, 5)


def parse_version(text: str) -> tuple[int, int]:
    """``"2.5.1+cu124"`` -> ``(2, 5)``; ``ValueError`` for a string that does not start with two numbers."""
    match = re.match(r"^\s*(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"cannot read a version from {text!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str) -> None:
    """``ConfigError`` if ``version`` (``torch.__version__``) is older than ``MIN_TORCH``."""
    try:
        have = parse_version(version)
    except ValueError:
        return  # a development build with an unusual version string: let it run
    if have < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ConfigError(
            f"torch {version} is older than {need}, which this code needs (attention with grouped query heads); "
            f"install a newer one: pip install 'torch>={need}'"
        )
