"""What a run shows people: the run and memory reports, charts, and Prefect artifacts kept one per kind."""
