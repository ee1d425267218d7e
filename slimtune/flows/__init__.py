"""Prefect flows."""

from slimtune.flows.finetune import finetune

__all__ = ["finetune"]
