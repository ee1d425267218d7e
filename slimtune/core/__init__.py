"""Primitives and tables every layer reads: atomic writes, bounded parsing, device, GGUF types, live models."""
