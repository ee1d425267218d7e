"""What `validate` and `run` check outside the spec before any model loads: machine, model files, data."""
