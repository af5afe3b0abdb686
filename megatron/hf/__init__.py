"""Hugging Face ``transformers`` checkpoints: export a checkpoint as a directory ``AutoModelForCausalLM`` loads,
import such a directory as a checkpoint of any tp x pp layout (``megatron.hf.convert``).

Two layouts (one file each) map our global parameter names onto Hugging Face's: GPT-2 (learned absolute positions,
LayerNorm, GeLU, biases) and Llama (rotary positions, RMSNorm, SwiGLU, grouped-query attention).  A model with a
feature neither layout has is refused with one line naming the feature."""

from megatron.hf.convert import export_hf, import_hf

__all__ = ["export_hf", "import_hf"]
