"""Attention variants and the one attention function they share."""

from kvlab.attention.core import attend
from kvlab.attention.gqa import GroupedQueryAttention
from kvlab.attention.rope import apply_rope

__all__ = ["GroupedQueryAttention", "apply_rope", "attend"]
