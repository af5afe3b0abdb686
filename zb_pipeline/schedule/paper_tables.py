"""Published cost tables the schedule targets and benchmarks are measured against (data only).

``ZB_V_TABLE``: the zero-bubble paper's ZB-V table (Qi et al. 2023, its Table 8): model, p, m, per-chunk F, B, W and
T_comm in microseconds, and the paper's 1F1B, ZB-H1 and ZB-V bubble rates.  ``tests/test_v_targets.py`` asserts our
V schedules against it and ``tools/bench_schedules.py`` reports it.
"""

from __future__ import annotations

ZB_V_TABLE: tuple[tuple[str, int, int, int, int, int, int, float, float, float], ...] = (
    ("6.2B", 16, 48, 14407, 14380, 9676, 1610, 0.2668, 0.1536, 0.0697),
    ("6.2B", 16, 64, 14412, 14393, 9688, 1621, 0.2206, 0.1198, 0.0533),
    ("6.2B", 16, 128, 14316, 14306, 9639, 1619, 0.1390, 0.0637, 0.0274),
    ("14.6B", 24, 72, 6763, 6969, 5251, 755, 0.2699, 0.1439, 0.0638),
    ("14.6B", 24, 96, 6783, 6984, 5259, 758, 0.2229, 0.1121, 0.0483),
    ("14.6B", 24, 192, 6785, 6990, 5260, 770, 0.1403, 0.0595, 0.0250),
    ("28.3B", 32, 96, 9458, 9748, 7288, 879, 0.2676, 0.1429, 0.0593),
    ("28.3B", 32, 128, 9469, 9744, 7306, 892, 0.2204, 0.1111, 0.0451),
    ("28.3B", 32, 256, 9447, 9644, 7193, 887, 0.1362, 0.0593, 0.0236),
)
