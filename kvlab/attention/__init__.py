"""Attention variants and the one attention function they share."""

from kvlab.attention.core import attend
from kvlab.attention.gqa import GroupedQueryAttention
from kvlab.attention.mla import MultiHeadLatentAttention, absorbed_attention, expanded_attention
from kvlab.rope import apply_rope

__all__ = [
    "GroupedQueryAttention",
    "MultiHeadLatentAttention",
    "absorbed_attention",
    "apply_rope",
    "attend",
    "expanded_attention",
]
