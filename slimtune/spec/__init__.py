"""The pipeline spec: its schema, validated by pydantic, and `--set` overrides of it."""
