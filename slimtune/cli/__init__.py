"""The command line: `slimtune init|validate|plan|run|eval|generate|chat`, and what the terminal shows."""
