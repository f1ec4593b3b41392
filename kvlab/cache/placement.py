"""Where a step's new tokens go in a cache and what each of them may see.

    causal_mask(q_positions [B, T], kv_lengths [B], kv_size) -> bool[B, T, S]
    Placement(positions, fresh_mask, slots, lengths, num_tokens)
    place_without_cache(batch, length, window=0) -> Placement   (the plain forward)
    write_tokens(buffer, new, slots, axis) -> buffer      (the one cache write)

Each cache kind places tokens itself (`Cache.place`): positions follow the
row's length, slots are where its storage puts them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Shaped

from kvlab import backends


def causal_mask(
    q_positions: Int[Array, "B T"], kv_lengths: Int[Array, " B"], kv_size: int
) -> Bool[Array, "B T S"]:
    """True where a query may see a key: the key is not later and is written.

    `q_positions` are the queries' positions among the keys; keys sit at
    positions 0..kv_size-1 and only the first `kv_lengths[b]` of row b exist.
    """
    key_positions = jnp.arange(kv_size)
    not_later = key_positions[None, None, :] <= q_positions[:, :, None]
    written = key_positions[None, None, :] < kv_lengths[:, None, None]
    return not_later & written


class Placement(NamedTuple):
    """Where one step's T new tokens go and what each of them may see.

    positions    int32[B, T]    absolute positions (RoPE angles follow them)
    fresh_mask   bool[B, T, T]  new token t sees new token t' <= t, if t' is real
    slots        int32[B, T]    cache slot of each token; S (dropped) for padding
    lengths      int32[B]       tokens each row held before this step
    num_tokens   int32[B]       real tokens among the T of each row
    pages        int32[B, n]    paged caches: the row's block table (page of each
                                run of page_size slots; -1 where none is held)
    transforms   per cached tensor, the kvlab.cache.transforms.Transform the cache
                 applies before storing it (static; () without a cache: none)
    compress     bool[B] | None  rows whose write compresses their cache to its
                 target (cache.evict.when='after_prefill'; other layers ignore it)
    context      int32[B] | None  the tokens of the whole context a compressing row's
                 target is taken of (a context prefilled in blocks); None: the row's
                 length after the step. Over a cache that probes (`Cache.probes`:
                 KVzip), a row's tokens at positions >= context are probes: they
                 attend and are observed, and are never stored (`stored_end`)
    """

    positions: Int[Array, "B T"]
    fresh_mask: Bool[Array, "B T T"]
    slots: Int[Array, "B T"] | None = None
    lengths: Int[Array, " B"] | None = None
    num_tokens: Int[Array, " B"] | None = None
    pages: Int[Array, "B n"] | None = None
    transforms: tuple = ()
    compress: Bool[Array, " B"] | None = None
    context: Int[Array, " B"] | None = None


def stored_end(
    lengths: Int[Array, " B"], num_tokens: Int[Array, " B"], context: Int[Array, " B"] | None
) -> Int[Array, " B"]:
    """int32[B]: each row's length after a step: lengths + num_tokens, or where a
    probing row's `context` (> 0) ends earlier, there (its tokens past it are
    probes, Placement.context), never below `lengths`."""
    end = lengths + num_tokens
    if context is None:
        return end
    return jnp.where(context > 0, jnp.clip(context, lengths, end), end)


def place_without_cache(batch: int, length: int, window: int = 0, sinks: int = 0) -> Placement:
    """The plain causal forward: positions 0..T-1, nothing cached; with a
    `window` (model.sliding_window), a query at p sees only positions > p - window,
    and the first `sinks` (model.sliding_sinks)."""
    steps = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = causal_mask(steps, jnp.full((batch,), length), length)
    if window:
        keys = steps[:, None, :]
        mask = mask & ((keys > steps[:, :, None] - window) | (keys < sinks))
    return Placement(steps, mask)


def write_tokens(
    buffer: Shaped[Array, "B ..."],
    new: Shaped[Array, "B ..."],
    slots: Int[Array, "B T"],
    axis: int = 1,
) -> Shaped[Array, "B ..."]:
    """Writes token t of row b at position slots[b, t] along the buffer's `axis`.

    `new` has the buffer's layout with T tokens in place of the buffer's S
    along `axis` (a [B, K, S, H] buffer with axis 2 takes [B, K, T, H]).
    Slots outside 0..S-1 are dropped, negative ones included. Slots may also
    be given per head, int32[B, E, T] with E = 1 or the buffer's heads, on
    axis 2 (evicting caches put each head's token in its own slot).

    The one write into any cache buffer (page pools too: kvlab/cache/paged.py
    writes through it). `jax.lax.dynamic_update_slice` would move an
    out-of-range write back onto the last rows without a word, and an indexed
    update wraps negative indices onto the end; a scatter in "drop" mode with
    negative slots moved past the end writes exactly the slots asked for and
    nothing else, so padding tokens (slot S) and overflowing tokens vanish
    instead of overwriting real ones. The backend of the forward being traced
    (kvlab.backends.writer) may write instead, with the same semantics (e.g.
    kvlab/kernels/native: a 16-bit buffer in place on the CPU).
    """
    slots = jnp.where(slots < 0, buffer.shape[axis], slots)
    written = backends.writer().write(buffer, new, slots, axis)  # a backend's kernel, or None
    return scatter_tokens(buffer, new, slots, axis) if written is None else written


def scatter_tokens(buffer, new, slots, axis: int = 1):
    """write_tokens' reference: one scatter in "drop" mode (slots of S and more,
    negative ones moved there, are dropped)."""
    slots = jnp.where(slots < 0, buffer.shape[axis], slots)
    if slots.ndim == 3:  # per head: slots [B, E, T] on a [B, KH, S, ...] buffer (E = 1 or KH)
        rows = jnp.arange(buffer.shape[0])[:, None, None]
        heads = jnp.arange(buffer.shape[1])[None, :, None]
        # The selected entries come out [B, KH, T, ...], as `new` is laid out.
        return buffer.at[rows, heads, slots].set(new.astype(buffer.dtype), mode="drop")
    rows = jnp.arange(buffer.shape[0])[:, None]
    index = (rows,) + (slice(None),) * (axis - 1) + (slots,)
    # Indexed this way the selected entries come out [B, T, (axes before `axis`), ...].
    values = jnp.moveaxis(new, axis, 1).astype(buffer.dtype)
    return buffer.at[index].set(values, mode="drop")
