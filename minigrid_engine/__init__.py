"""minigrid: a paged-attention engine you can break and fix (the GLM 5.3 / SGLang KV-cache leak)."""

__version__ = "0.1.0"
