"""Prefect flows: the flow is `slimtune.flows.finetune.finetune`.

The package imports nothing itself: a torchrun rank (`python -m slimtune.flows`), a crash hook's `resubmit` or a
`gpu_slots` user loads only what it needs, not the whole flow's imports (~10 s on a busy 2-core machine).
"""
