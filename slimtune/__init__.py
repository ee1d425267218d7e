"""slimtune: QLoRA fine-tuning on as little GPU memory as possible, shipped as GGUF, as one Prefect 3 flow.

Run it with `slimtune run SPEC` or `slimtune.flows.finetune(spec)`; the spec is `slimtune.spec.schema.PipelineSpec`.
"""

__version__ = "0.1.0"
