"""ddtree: exact DDTree (Diffusion Draft Tree) speculative decoding for Qwen3.5/3.6 hybrids and Qwen3."""

__version__ = "0.1.0"
