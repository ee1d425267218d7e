"""The training step: what runs in each forward and backward beyond the model's own code, in one folder.

Set up once per model, by attach_lora:
- `checkpointing`: each decoder layer's forward replaced on the instance (`enable_checkpointing`); "unsloth"
  recomputes a layer in its backward from its input, parked on the host by `offload`. Which pass of a layer runs
  (`LayerPass`) is one object per model, which the kernels (`kernels.apply_kernels`'s `checkpoint_pass`) read.

Set up per `train_adapter` call, by the trainer:
- `attention`: packed rows through varlen flash attention (`prefer_varlen`), without a T x T mask.
- `fp32_rope`: under FSDP, RoPE's `inv_freq` kept in float32 (`keep_rope_fp32`).
- `context`: around `Trainer.train`, `step_context` enters `walks` (the model's per-step walks from lists),
  the layers' parameter lists and `layer_graphs` (each layer's backward as a CUDA graph).
"""

from slimtune.train.step.checkpointing import CheckpointingHandle, LayerPass, enable_checkpointing
from slimtune.train.step.context import Step, StepSettings, step_context

__all__ = ["CheckpointingHandle", "LayerPass", "Step", "StepSettings", "enable_checkpointing", "step_context"]
