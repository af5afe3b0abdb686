"""zb_pipeline: zero-bubble pipeline schedules and the runtime that executes them.

A standalone library: it knows nothing of GPT, tokenizers or checkpoints, and never imports ``megatron``.
"""

__version__ = "0.1.0"
