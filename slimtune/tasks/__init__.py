"""The six stages as plain functions (callable without Prefect); the flow wraps each in a guarded task."""
