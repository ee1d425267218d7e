"""Model families and their configs, the built-in tiny models, and where a model's files come from."""
