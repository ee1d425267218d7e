"""Typed merge errors: each names the file or spec field at fault and the fix, so a flow reports it as-is."""

from __future__ import annotations


class MergeError(RuntimeError):
    """Base class of every error `merge_adapter` raises on purpose (not retriable by downshifting)."""


class AlreadyMergedError(MergeError):
    """The base model is itself a merge output; merging onto it would apply the adapter twice."""


class AdapterMismatchError(MergeError):
    """The adapter does not fit the base: a target tensor is missing or its shape disagrees."""


class DiskSpaceError(MergeError):
    """Not enough disk for the output or the spill files (found by the preflight or by ENOSPC mid-write)."""
