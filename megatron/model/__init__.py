"""The GPT decoder, written like single-device code; tensor parallelism comes from the layers it is built of."""

from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTStage, build_gpt_model, build_gpt_stages, stage_layer_ranges

__all__ = ["GPTConfig", "GPTStage", "build_gpt_model", "build_gpt_stages", "stage_layer_ranges"]
