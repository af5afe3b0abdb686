"""ZB-Megatron trainer: GPT model, tensor/data/pipeline parallelism, data, optimizer, checkpoints."""
