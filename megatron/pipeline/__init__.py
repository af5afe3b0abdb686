"""The trainer's side of pipeline parallelism: schedule flags and one iteration through ``zb_pipeline``'s runtime."""

from megatron.pipeline.forward_backward import GPTPipeline, build_gpt_pipeline
from megatron.pipeline.schedule_flags import ScheduleConfig, add_schedule_args

__all__ = ["GPTPipeline", "ScheduleConfig", "add_schedule_args", "build_gpt_pipeline"]
