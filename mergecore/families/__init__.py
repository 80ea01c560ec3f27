"""Model families as data: HF name and shape tables, Megatron and torchtitan name tables, the two-way tensor transforms, and the config check against transformers."""

from .registry import Family, register_family

__all__ = ["Family", "register_family"]
