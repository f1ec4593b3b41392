"""The KV cache pytree: per-layer storage, per-row lengths and error flags.

The cache is an immutable pytree threaded through `model.apply`; every step
returns a new one. Row b holds `lengths[b]` tokens at positions
0..lengths[b]-1; the next tokens given to the model are written after them,
so rows of a batch may hold different lengths (ragged batches). The fields,
each storage kind's layout and the read/write contract are documented once,
in docs/caches.md ("The cache pytree"); `kvlab.cache.init_cache` builds one.

This module holds the `Cache` itself and the contiguous storage,
`DenseLayer`: each cached tensor as one [B, K, S, W] buffer in cache.dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Int

from kvlab import sharding
from kvlab.cache import transforms
from kvlab.cache.placement import Placement, causal_mask, write_tokens

# Bits of Cache.errors: what a compiled step was given that it could not run.
OVERFLOW = 1  # more tokens than the capacity holds: those past it were dropped
BAD_TOKEN = 2  # a real token's id outside 0..vocab_size-1
BAD_COUNT = 4  # num_tokens outside 0..T, or a negative length
ERRORS = {
    OVERFLOW: "was given more tokens than the cache holds (the tokens past its capacity "
    "were dropped): init the cache with a larger max_len",
    BAD_TOKEN: "was given a token id outside the vocabulary: pass ids in 0..model.vocab_size-1",
    BAD_COUNT: "was given num_tokens outside 0..T (the step's length) or held a negative "
    "length: pass 0 <= num_tokens <= T and keep lengths >= 0",
}


class CacheError(ValueError):
    """A compiled step flagged invalid input for some rows (Cache.errors)."""


def check_errors(errors: Int[Array, " B"]) -> None:
    """Raises CacheError naming each row whose error flags (Cache.errors) are set."""
    errors = sharding.fetch(errors)  # every host: its rows may live on others
    problems = [
        f"row {row} {message}"
        for row in np.flatnonzero(errors)
        for bit, message in ERRORS.items()
        if errors[row] & bit
    ]
    if problems:
        raise CacheError("; ".join(problems))


@struct.dataclass
class DenseLayer:
    """One layer's cached tensors in the cache dtype, each [B, K, S, W]."""

    tensors: tuple

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[2]

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.shape[1], t.shape[3]) for t in self.tensors)

    def read(self, fresh: tuple, placement: Placement):
        """The cache as it is (mask [B, 1, S]: written slots) and the new tokens
        as it will hold them (placement.fresh_mask); and those tokens, for `write`."""
        fresh = tuple(x.astype(t.dtype) for x, t in zip(fresh, self.tensors, strict=True))
        written = jnp.arange(self.capacity) < placement.lengths[:, None]  # [B, S]
        return [(self.tensors, written[:, None, :]), (fresh, placement.fresh_mask)], fresh

    def observe(self, placement: Placement) -> None:
        """Keeps every token: no query's attention is needed."""
        return None

    def write(self, fresh: tuple, placement: Placement, mass=None) -> DenseLayer:
        """Stores the new tokens at `placement.slots` (see write_tokens)."""
        return DenseLayer(
            tuple(
                write_tokens(t, x, placement.slots, axis=2)
                for t, x in zip(self.tensors, fresh, strict=True)
            )
        )


@struct.dataclass
class Cache:
    """Per-layer storage, the tokens each row holds and what went wrong.

    layers   one CacheLayer per transformer layer (kvlab/cache/protocols.py)
    lengths  int32[B]  tokens written per row (above capacity after an overflow)
    errors   int32[B]  OVERFLOW | BAD_TOKEN | BAD_COUNT bits set by compiled
                       steps; `check()` raises on the host when any is set
    tensors  static: what each layer caches (kvlab.config.cached_tensors), so a
             model refuses a cache made for another model
    transforms  static: per cached tensor, the name of the transform applied before
             it is stored (cache.<prefix>_transform; kvlab/cache/transforms), handed
             to the attention modules with each step's placement
    """

    layers: tuple
    lengths: Int[Array, " B"]
    errors: Int[Array, " B"]
    tensors: tuple = struct.field(pytree_node=False)  # CachedTensor per cached tensor
    transforms: tuple = struct.field(pytree_node=False)  # a transform's name per tensor

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def probes(self) -> bool:
        """Whether a compressing step's tokens past a row's context are probes that
        are not stored (an evicting layer whose scorer observes "probes": KVzip)."""
        return any(
            getattr(getattr(layer, "policy", None), "probes", False) for layer in self.layers
        )

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def overflowed(self) -> jax.Array:
        """bool[B]: rows that were given more tokens than the capacity holds."""
        return self.lengths > self.capacity

    def check(self) -> None:
        """Raises CacheError naming each flagged row and what it was given.

        Inside compiled code nothing can raise: a step that is given invalid
        values flags the row, writes nothing for it (an overflow writes what
        fits) and returns NaN logits for it. Every host loop calls this.
        """
        check_errors(self.errors)

    def place(self, length: int, num_tokens: Int[Array, " B"]) -> Placement:
        """Places T new tokens per row (num_tokens[b] real) after the cached ones,
        with the cache's transforms."""
        placement = place_after(self.lengths, self.capacity, length, num_tokens)
        return placement._replace(transforms=transforms.resolve(self.transforms))


def place_after(
    lengths: Int[Array, " B"], capacity: int, length: int, num_tokens: Int[Array, " B"]
) -> Placement:
    """T new tokens per row (num_tokens[b] real) at the slots after each row's length."""
    steps = jnp.arange(length, dtype=jnp.int32)
    relative = jnp.broadcast_to(steps, (lengths.shape[0], length))
    # Padding goes to slot S, which every cache write drops.
    slots = jnp.where(steps < num_tokens[:, None], lengths[:, None] + steps, capacity)
    return Placement(
        positions=lengths[:, None] + steps,
        fresh_mask=causal_mask(relative, num_tokens, length),
        slots=slots,
        lengths=lengths,
        num_tokens=num_tokens,
    )
