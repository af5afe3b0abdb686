"""The torch floor: one constant, stated the same in pyproject.toml, checked at start-up with one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron.config.errors import ConfigError
from megatron.requirements import MIN_TORCH, check_torch, parse_version

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_states_the_same_floor() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([\d.]+)"', text)
    assert floor is not None and parse_version(floor.group(1)) == MIN_TORCH


@pytest.mark.parametrize("version", ["2.4.1+cu121", "2.1.0", "1.13.1"])
def test_older_torch_is_one_line_with_the_fix(version: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_torch(version)
    msg = str(info.value)
    assert "\n" not in msg and version in msg and "pip install 'torch>=2.5'" in msg


@pytest.mark.parametrize("version", ["2.5.0", "2.13.0+cpu", "3.0.0a0", "weird-build"])
def test_new_enough_or_unreadable_versions_run(version: str) -> None:
    check_torch(version)
