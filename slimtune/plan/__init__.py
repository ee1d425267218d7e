"""What a run will do, decided from the spec before any model loads: run plan, train settings, fit."""
