"""Checkpoint loading (safetensors) and GPU destinations; ``pfs.load_safetensors`` is the entry."""
