"""Eviction scorers: how much each token deserves to stay (cache.evict.method).

    class Tova(Scorer):                 # a method is one class (kvlab/cache/evict/tova.py)
        name, observes = "tova", "last"
        def score(self, c: Candidates):  # float32[B, E, C]
            return attention(c).mean(1, keepdims=True) * jnp.ones_like(c.valid)
    SCORERS.register(Tova())            # or one line in kvlab.registry.SCORERS.shipped

An evicting layer (kvlab/cache/evict/layers.py) stores a budget of slots per
KV head. Each step the stored tokens and the step's new ones compete for them:
the `recent` latest positions always stay, the rest by the scorer's score
(highest stay). The layer gathers what a scorer may read into `Candidates`
(the same for tokens stored one by one and for the settled groups of g tokens
of a quantized layout with a residual window or per-channel scales: one score
serves both), the scorer returns one number per candidate, and the layer does
the rest: the competition, the writes, the byte count. What a scorer declares
drives everything else (kvlab.config's validation, kvlab.cache.accounting's
bytes, the cache's label, the eviction sweep's grid):

    name          cache.evict.method
    observes      None, or whose attention and queries the layer hands it
                  (`Candidates.mass`, `.queries`):
                  "all" (every real query of a step, h2o), "window" (the last
                  cache.evict.obs_window, snapkv), "last" (the last one) or
                  "probes" (tokens fed after the context in the step that
                  compresses it, attending to it and never stored: KVzip's
                  reconstruction, `probe_tokens`; Placement.context)
    peaks         `Candidates.mass` is each token's largest probability from an
                  observed query (and query head of its group), not their sum
    keeps         a float32 per slot carried to the next step (the score of a kept
                  token: h2o's accumulated attention), counted in the cache's bytes
    static        a candidate's score is a function of that candidate alone (its
                  keys, values, tag and position) and never changes: where a layer
                  competes every step, it carries the scores of its slots (as
                  `keeps`, counted the same) and scores only the step's new tokens
    pooled        a layer's K heads share one pool of K x budget slots, each head at
                  least cache.evict.adakv_floor x budget (adakv)
    reads_hidden  it reads the step's tokens' hidden states (`Candidates.hidden`:
                  fast_kvzip's gate), which only the step that brings a token has, so
                  it `keeps` each token's score and refuses layouts that settle tokens
                  in groups later
    weighs        its priority reads a weight per token that is a function of the
                  token alone (CriticalKV's value norm): a layer storing tokens one by
                  one weighs each as it arrives (`weigh`) and carries the weight per
                  slot (`Candidates.weights`, counted in the bytes) instead of
                  weighing every candidate at each competition
    prefix_unsafe why shared prompt pages cannot stand for its state (None: they can)
    attention_kinds  the model.attention kinds it can score (expected_attention
                  needs the queries before RoPE, which only 'gqa' offers)
    stepwise      its definition evicts at every step (h2o, tova, duo_attention's
                  sliding windows): cache.evict.interval=0, the method's own, is 1
                  for it; other scorers, defined by one compression, evict in
                  batches (policy.method_interval)
    calibrated    it reads an artefact computed offline for the model (qfilter's
                  filters, named in its options), so sweeps of freshly trained
                  models leave it out
    fields        the shared cache.evict fields it reads, besides budget and ratio
    defaults      its own options and their defaults: cache.evict.options, which
                  may set any of them ({'pooling': 'mean'}); `check` refuses values
    probe_tokens()  the probes to feed after a context (observes "probes")
    key_channels()  the channels of each key a slot stores (fewer under a wrapper
                  that prunes them: ThinK), and choose_channels() which (`Channels`)
    weigh()       float32[B, E, C]: each candidate's weight (`weighs`)
    budgets()     the per-layer budgets (pyramidkv), uniform by default
    priority()    what the competition compares, from its score (default: the
                  score; a scorer that `keeps` its score may rank by another number)

A wrapper (`Wrapper`, kvlab.registry.WRAPPERS: kvpress's wrapper presses) applies
over any scorer: cache.evict.method='chunkkv:snapkv' is ChunkKV over SnapKV's
scores (wrappers nest: 'a:b:snapkv'). It turns the scorer's priorities into its
own and adds its options; the scorer's state, observations and layout stay.

Built in here: h2o, snapkv, pyramidkv, adakv, knorm, random; beside, a file
each: tova, keydiff, lagkv, expected_attention, qfilter, duo_attention, kvzip,
kvzip_head, fast_kvzip (scorers), chunkkv, criticalkv, per_layer and think (wrappers).
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from kvlab.config.schema import COMPOSED_OPTIONS
from kvlab.files import read_arrays
from kvlab.registry import SCORERS, WRAPPERS


@dataclasses.dataclass(frozen=True)
class Candidates:
    """What a scorer reads: per storage head E (a KV head; one for a latent or a
    pooled layer), the C candidates for its slots, the `held` stored ones first,
    then the step's new ones; each a token or a settled group of `group` tokens.

    tags       int32[B, E, C]   each candidate's id: its (first) position, or
                                position x K + KV head in a pooled layer; -1 none
    valid      bool[B, E, C]    a real candidate
    positions  int32[B, E, C]   its (first) position, -1 none
    heads      int32[B, E, C]   the KV head it belongs to
    mass       float32[B, E, C, group] | None   the attention each of its tokens
               received from the queries the scorer observes (summed over them,
               averaged over each KV head's query heads); None when it observes none
    state      float32[B, E, held] | None   what the scorer kept per slot (`keeps`)
    keys       () -> float32[B, E, C, group, W]   its keys as stored (quantized:
               dequantized), the first cached tensor (a latent model's latent)
    kernel, seed, layer, kv_heads   the layer's policy fields scorers read
    queries    float32[B, K, Q, W] | None   the step's queries of each KV head
               (a latent model: one, the latent) as they meet `keys`: after RoPE
               and the cache's transform (a latent model's: W_UK folded in, the
               RoPE part left out), Q = T steps x G query heads (x the layers of
               a cross-layer run); per KV head also in a pooled layer (E = 1:
               `heads` picks); None when the scorer observes none
    query_weights  float32[B, Q] | None   1 for the queries the scorer observes
               (its `observes`), 0 for the others and padding
    query_positions  int32[B, Q] | None   each query's position
    query_groups   G, the query heads of a KV head (Q = steps x G, head g at q mod G)
    raw_queries    float32[B, K, Q, W] | None   the same queries before RoPE and the
               cache's transform (None where positions do not enter the scores with
               the first cached tensor: a latent model)
    rotate     (x [B, K, Q', W], positions [B, Q'] or [B, 1], span=1) -> [B, K, Q', W]: raw
               vectors as queries at `positions` meet the keys (RoPE, then the
               transform; span > 1: the mean over each position and the span - 1
               after it); None with raw_queries
    values     () -> float32[B, E, C, group, Wv]   its values as stored (quantized:
               dequantized; a latent model: the latent, which values are read from)
    keep       int32[B, E, 1]   the candidates each head keeps after this step (its
               slots less cache.evict.interval's spare, a compressed row's target, or
               all of them where they fit)
    output_norms  (values [B, K, X, Wv] as stored) -> float32[B, K, G, X]: the L1 norm
               of each query head's output projection of each value (grouped-query
               attention, for scorers that observe; CriticalKV), else None
    key_transform  the cache's transform of its first tensor (kvlab/cache/transforms),
               which `keys` went through; None without one
    max_len    the layer's capacity: every candidate's position is below it
               (`position_rank` counts positions; 0: unknown, it sorts them)
    end        int32[B, 1, 1]   each row's length after the step (the next position)
    observed   float32[B, 1, 1]   the queries of each row whose attention `mass` sums
    recent     the layer's cache.evict.recent: candidates holding one of a row's
               `recent` latest positions stay whatever their score (`always_kept`)
    options    the scorer's options (its `defaults` with cache.evict.options over them)
    weights    float32[B, E, C] | None   each candidate's `Scorer.weigh`, carried per
               slot by a layer of a scorer that `weighs` (None elsewhere: weigh them)
    hidden     float32[B, T, D] | None   the step's T tokens' hidden states as the
               (producing) attention read them, for a scorer that observes
               (`reads_hidden`: the new candidates are these tokens, in order per
               storage head; a pool's head-major); None when not offered
    """

    tags: Array
    valid: Array
    positions: Array
    heads: Array
    held: int
    group: int
    mass: Array | None
    state: Array | None
    keys: Callable[[], Array]
    kernel: int
    seed: int
    layer: int
    kv_heads: int
    queries: Array | None = None
    query_weights: Array | None = None
    query_positions: Array | None = None
    query_groups: int = 0
    raw_queries: Array | None = None
    rotate: Callable | None = None
    values: Callable[[], Array] | None = None
    keep: Array | None = None
    output_norms: Callable | None = None
    key_transform: object | None = None
    max_len: int = 0
    end: Array | None = None
    observed: Array | None = None
    recent: int = 0
    options: Mapping = dataclasses.field(default_factory=dict)
    weights: Array | None = None
    hidden: Array | None = None


@dataclasses.dataclass(frozen=True)
class Channels:
    """What a wrapper that prunes key channels (`Scorer.choose_channels`, ThinK)
    reads in a row's first write, when each KV head's channels are chosen.

    keys       float32[B, K, T, W]   the step's keys (after RoPE and the transform)
    kept       bool[B, K, T]   the ones the layer keeps after the step
    queries    float32[B, K, Q, W]   the step's queries as they meet the keys
               (Candidates.queries), with their positions int32[B, Q]
    end        int32[B]   each row's length after the step
    count      the channels each KV head keeps (its `key_channels`)
    width      W
    options    the method's options
    """

    keys: Array
    kept: Array
    queries: Array
    query_positions: Array
    end: Array
    count: int
    width: int
    options: Mapping


NO_OPTIONS: Mapping = types.MappingProxyType({})


class Scorer:
    """One eviction method (module docstring). `score` returns float32[B, E, C]."""

    name: str = ""
    observes: str | None = None
    peaks: bool = False
    keeps: bool = False
    static: bool = False
    pooled: bool = False
    reads_hidden: bool = False
    weighs: bool = False
    prefix_unsafe: str | None = None
    attention_kinds: tuple[str, ...] = ("gqa", "mla")
    stepwise: bool = False
    calibrated: bool = False
    fields: tuple[str, ...] = ("recent",)
    defaults: Mapping = NO_OPTIONS

    def check(self, options: Mapping, field: str) -> None:
        """Raises ValueError naming `field`.<option> for an option value it cannot use
        (`options`: its defaults with the config's over them)."""

    def budgets(self, budget: int, layers: int, evict: Mapping) -> tuple[int, ...]:
        """Tokens kept per KV head in each of `layers` layers, `budget` on average."""
        return (budget,) * layers

    def probe_tokens(self, encode: Callable[[str], list], context: list) -> list:
        """The token ids to feed after `context` (ids) in the step that compresses it,
        for a scorer that observes "probes"; `encode` turns text into ids."""
        raise NotImplementedError(f"{self.name} observes no probes")

    def key_channels(self, width: int, options: Mapping) -> int:
        """Channels of each key (of `width`) a slot stores: fewer under a wrapper
        that prunes them (ThinK, `choose_channels`)."""
        return width

    def choose_channels(self, c: Channels) -> Array:
        """int32[B, K, c.count]: the key channels each row's KV heads keep, ascending."""
        raise NotImplementedError(f"{self.name} prunes no key channels")

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...] | None:
        """Each layer's budget as a multiple of the mean (mean 1), or None: the
        layer's share of cache.evict.budget, or of the ratio of each row's context
        a compression keeps (per_layer). Read instead of `budgets` where given."""
        return None

    @property
    def reads_mass(self) -> bool:
        """Whether it reads the attention its candidates received (`Candidates.mass`):
        a scorer that observes does; a wrapper observes for the queries alone."""
        return self.observes is not None

    def score(self, c: Candidates) -> Array:
        raise NotImplementedError

    def weigh(self, c: Candidates) -> Array:
        """float32[B, E, C]: each candidate's weight, a function of it alone (`weighs`)."""
        raise NotImplementedError(f"{self.name} weighs no tokens")

    def priority(self, c: Candidates, score: Array) -> Array:
        """float32[B, E, C]: what the competition compares (higher stays)."""
        return score


class Wrapper:
    """A method over any scorer (module docstring): `priority` turns the scorer's
    priorities [B, E, C] into the wrapper's."""

    name: str = ""
    # queries it needs observed when its scorer observes none (their mass unread)
    observes: str | None = None
    weighs: bool = False  # as Scorer's, with `weigh`
    prefix_unsafe: str | None = None  # as Scorer's
    attention_kinds: tuple[str, ...] = ("gqa", "mla")
    fields: tuple[str, ...] = ()
    defaults: Mapping = NO_OPTIONS

    def check(self, options: Mapping, field: str) -> None:
        """As Scorer.check, for the wrapper's own options."""

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...] | None:
        """As Scorer.shares: per-layer budgets the wrapper sets over its scorer's."""
        return None

    def priority(self, c: Candidates, priority: Array) -> Array:
        return priority

    def weigh(self, c: Candidates) -> Array:
        """As Scorer.weigh."""
        raise NotImplementedError(f"{self.name} weighs no tokens")

    def key_channels(self, width: int, options: Mapping) -> int:
        """As Scorer.key_channels: a wrapper may prune the keys of any scorer."""
        return width

    def choose_channels(self, c: Channels) -> Array:
        raise NotImplementedError(f"{self.name} prunes no key channels")


class Wrapped(Scorer):
    """`wrapper` over `scorer`: cache.evict.method 'wrapper:scorer'."""

    def __init__(self, wrapper: Wrapper, scorer: Scorer):
        self.wrapper, self.scorer = wrapper, scorer
        self.name = f"{wrapper.name}:{scorer.name}"
        self.observes = scorer.observes or wrapper.observes
        self.peaks, self.keeps, self.pooled = scorer.peaks, scorer.keeps, scorer.pooled
        self.reads_hidden = scorer.reads_hidden
        self.static = scorer.static  # a wrapper turns priorities, never the scores
        self.stepwise = scorer.stepwise
        # one weight per slot: where several levels weigh, each weighs its candidates
        self.weighers = int(wrapper.weighs) + getattr(scorer, "weighers", int(scorer.weighs))
        self.weighs = self.weighers == 1
        self.prefix_unsafe = scorer.prefix_unsafe or wrapper.prefix_unsafe
        self.attention_kinds = tuple(
            k for k in scorer.attention_kinds if k in wrapper.attention_kinds
        )
        self.calibrated = scorer.calibrated
        self.fields = tuple(dict.fromkeys((*scorer.fields, *wrapper.fields)))
        self.defaults = types.MappingProxyType({**scorer.defaults, **wrapper.defaults})

    def check(self, options: Mapping, field: str) -> None:
        self.scorer.check(options, field)
        self.wrapper.check(options, field)

    def budgets(self, budget: int, layers: int, evict: Mapping) -> tuple[int, ...]:
        return self.scorer.budgets(budget, layers, evict)

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...] | None:
        own = self.wrapper.shares(layers, evict, context)
        if own is None:
            return self.scorer.shares(layers, evict, context)
        if sets_layers(self.scorer, layers, evict, context):
            raise ValueError(
                f"cache.evict.method={self.name!r}: {self.wrapper.name} sets each layer's "
                f"budget, and {self.scorer.name} sets its own: put {self.wrapper.name} over a "
                "scorer with one budget for every layer"
            )
        return own

    def probe_tokens(self, encode: Callable[[str], list], context: list) -> list:
        return self.scorer.probe_tokens(encode, context)

    @property
    def reads_mass(self) -> bool:
        return self.scorer.reads_mass  # a wrapper observes for the queries alone

    def score(self, c: Candidates) -> Array:
        return self.scorer.score(c)

    def weigh(self, c: Candidates) -> Array:
        return (self.wrapper if self.wrapper.weighs else self.scorer).weigh(c)

    def priority(self, c: Candidates, score: Array) -> Array:
        return self.wrapper.priority(c, self.scorer.priority(c, score))

    def key_channels(self, width: int, options: Mapping) -> int:
        own = self.wrapper.key_channels(width, options)
        return own if own < width else self.scorer.key_channels(width, options)

    def choose_channels(self, c: Channels) -> Array:
        if self.wrapper.key_channels(c.width, c.options) < c.width:
            return self.wrapper.choose_channels(c)
        return self.scorer.choose_channels(c)


class Composed(Scorer):
    """Two scorers one after the other (kvpress's ComposedPress): cache.evict.method
    'snapkv+knorm'. In each competition the first keeps its best
    ceil(kept / options.share) candidates of a head (the always-kept among them),
    and the second ranks those for the `kept` (Candidates.keep) that stay; the
    others go first. Scorers that keep a state per slot or share a pool cannot be
    staged, nor two that observe different queries; per-layer budgets are one
    stage's or the same in both."""

    def __init__(self, first: Scorer, second: Scorer):
        self.first, self.second = first, second
        self.name = f"{first.name}+{second.name}"
        where = f"cache.evict.method={self.name!r}"
        for part in (first, second):
            if part.keeps or part.pooled or part.peaks:
                what = (
                    "keeps a state per slot"
                    if part.keeps
                    else "pools its heads"
                    if part.pooled
                    else "reads peak probabilities"
                )
                raise ValueError(
                    f"{where}: {part.name} {what}, which a composition cannot stage: "
                    "compose scorers that score each step afresh"
                )
        observing = {first.observes, second.observes} - {None}
        if len(observing) > 1:
            raise ValueError(
                f"{where}: its scorers observe different queries "
                f"({' and '.join(sorted(observing))}): compose scorers that observe the "
                "same queries, or one that observes none"
            )
        self.observes = observing.pop() if observing else None
        self.prefix_unsafe = first.prefix_unsafe or second.prefix_unsafe
        self.attention_kinds = tuple(
            k for k in first.attention_kinds if k in second.attention_kinds
        )
        self.calibrated = first.calibrated or second.calibrated
        self.stepwise = first.stepwise or second.stepwise
        self.fields = tuple(dict.fromkeys((*first.fields, *second.fields)))
        self.defaults = types.MappingProxyType(
            {**first.defaults, **second.defaults, **COMPOSED_OPTIONS}
        )

    def check(self, options: Mapping, field: str) -> None:
        self.first.check(options, field)
        self.second.check(options, field)

    def key_channels(self, width: int, options: Mapping) -> int:
        for part in (self.first, self.second):
            if part.key_channels(width, options) < width:
                raise ValueError(
                    f"cache.evict.method={self.name!r}: {part.name} prunes the keys' channels, "
                    "which every stage of a layer shares: prune them in a method that is "
                    "not composed (e.g. 'think:snapkv')"
                )
        return width

    def budgets(self, budget: int, layers: int, evict: Mapping) -> tuple[int, ...]:
        return self._setter(layers, evict).budgets(budget, layers, evict)

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...] | None:
        return self._setter(layers, evict, context).shares(layers, evict, context)

    def _setter(self, layers: int, evict: Mapping, context: int = 1) -> Scorer:
        """The stage that sets per-layer budgets (shares, or budgets that differ by
        layer; the first where neither does); refused where both do."""
        setting = [
            part for part in (self.first, self.second) if sets_layers(part, layers, evict, context)
        ]
        if len(setting) > 1:
            raise ValueError(
                f"cache.evict.method={self.name!r}: both stages set per-layer budgets: "
                "give them to one stage"
            )
        return setting[0] if setting else self.first

    def score(self, c: Candidates) -> Array:
        return self.first.score(c)

    def priority(self, c: Candidates, score: Array) -> Array:
        first = jnp.where(c.valid, self.first.priority(c, score), -jnp.inf)
        first = jnp.where(always_kept(c), jnp.inf, first)
        staged = jnp.ceil(c.keep / c.options["share"]).astype(jnp.int32)
        second = self.second.priority(c, self.second.score(c))
        return jnp.where(best(first, staged), second, -jnp.inf)


def sets_layers(scorer: Scorer, layers: int, evict: Mapping, context: int) -> bool:
    """Whether `scorer` sets budgets that differ by layer (its shares, or budgets
    that are not one number for every layer)."""
    probe = 1 << 20  # a budget whose per-layer schedule shows
    if scorer.shares(layers, evict, context) is not None:
        return True
    return scorer.budgets(probe, layers, evict) != (probe,) * layers


def base_scorers(method: str) -> list[str]:
    """The scorers a scored cache.evict.method names, each without its wrappers
    ('criticalkv:snapkv+knorm': snapkv, knorm)."""
    return [stage.split(":")[-1] for stage in method.split("+")]


def compose(method: str) -> Scorer:
    """The scorer of a scored cache.evict.method: 'snapkv', wrappers over a scorer,
    outermost first ('chunkkv:snapkv'), or two of those composed ('snapkv+knorm')."""
    if "+" in method:
        return Composed(*(compose(stage) for stage in method.split("+")))
    *wrappers, base = method.split(":")
    scorer = SCORERS.get(base)
    for name in reversed(wrappers):
        scorer = Wrapped(WRAPPERS.get(name), scorer)
    return scorer


def attention(c: Candidates) -> Array:
    """float32[B, E, C]: the attention each candidate (its tokens together) received."""
    return c.mass.sum(-1)


def always_kept(c: Candidates) -> Array:
    """bool[B, E, C]: the candidates the layer keeps whatever their score (those
    holding one of a row's `recent` latest positions)."""
    if not c.recent:
        return jnp.zeros(c.valid.shape, bool)
    return c.valid & (c.positions + (c.group - 1) >= c.end - c.recent)


def pooled_max(score: Array, c: Candidates) -> Array:
    """Max of each candidate's score over the `kernel` nearest positions of its
    KV head (SnapKV's pooling, kvlab's default): score [B, E, C]."""
    if c.kernel == 1:
        return score
    larger = lambda best, moved, ok: jnp.where(ok, jnp.maximum(best, moved), best)  # noqa: E731
    return _pooled(score, c, c.valid, larger)


def pooled_mean(score: Array, c: Candidates) -> Array:
    """Mean of each candidate's score over the `kernel` nearest positions of its KV
    head, those that are no scored candidate (before the first, past the last,
    or always kept: the observation window) counting as zero: SnapKV's reference
    code and kvpress (average pooling over the prefix before the window, zero
    padded, divided by the kernel). score [B, E, C]."""
    counted = c.valid & ~always_kept(c)
    if c.kernel == 1:
        return score
    add = lambda total, moved, ok: total + jnp.where(ok, moved, 0.0)  # noqa: E731
    return _pooled(jnp.where(counted, score, 0.0), c, counted, add) / c.kernel


def _pooled(score: Array, c: Candidates, counted: Array, fold) -> Array:
    """Each valid candidate's score folded (`fold(acc, neighbour, ok)`) with those
    of the `kernel` // 2 nearest candidates of its KV head on each side in
    position order (`ok`: the neighbour exists and is `counted`): score [B, E, C]."""
    rank = position_rank(c)
    # In rank order: the scores and whether each is counted, in one gather; the valid
    # ones are the first n; a pool's heads run one after another.
    order = position_order(rank)[..., None]
    packed = jnp.stack([score, counted.astype(score.dtype)], axis=-1)
    s, n = jnp.moveaxis(jnp.take_along_axis(packed, order, axis=-2), -1, 0)
    n = n > 0
    edge = jnp.arange(s.shape[-1])
    v = edge < c.valid.sum(-1, keepdims=True)
    h = None
    if c.valid.shape[1] == 1 and c.kv_heads > 1:  # a pool: the head of each rank
        per_head = (c.valid & (c.heads == jnp.arange(c.kv_heads)[:, None, None, None])).sum(-1)
        h = (edge >= jnp.cumsum(per_head, axis=0)[..., None]).sum(0)  # [B, 1, C]
    out = s
    for shift in range(1, c.kernel // 2 + 1):
        for d in (shift, -shift):
            ok = jnp.roll(n, d, axis=-1)
            if h is not None:
                ok = ok & (jnp.roll(h, d, axis=-1) == h)
            ok = ok & ((edge >= d) if d > 0 else (edge < s.shape[-1] + d))
            out = fold(out, jnp.roll(s, d, axis=-1), ok & v)
    return jnp.take_along_axis(out, rank, axis=-1)  # back to candidate order


def position_order(rank: Array) -> Array:
    """int32[B, E, C]: the candidates in the order `position_rank` gives them
    (order[.., i] is the candidate of rank i)."""
    b = jnp.arange(rank.shape[0])[:, None, None]
    e = jnp.arange(rank.shape[1])[None, :, None]
    return jnp.zeros_like(rank).at[b, e, rank].set(jnp.arange(rank.shape[-1]))


PAIRWISE_RANKS = 256  # rows at most this long are ranked by comparing every pair


def running_count(x: Array) -> Array:
    """int32: the running sum of integer or bool `x` along its last axis, by a
    parallel prefix (jax.lax.associative_scan; exact for integers): XLA:CPU
    lowers jnp.cumsum to a reduce-window that costs about four times more over
    a row of 12k (position_rank's marks over max_len at 8k tokens: 400 against
    104 us a layer)."""
    return jax.lax.associative_scan(jnp.add, x.astype(jnp.int32), axis=x.ndim - 1)


def ranks(x: Array) -> Array:
    """int32: each entry's place along the last axis in ascending order, among equals
    the earlier first (argsort of the argsort; NaN last, -0 equal to 0). A row of
    up to PAIRWISE_RANKS entries counts, for each entry, those below it and the
    equal ones before it (LagKV's partitions of 128: 3.3x faster than XLA:CPU's
    comparison sort); a longer one by one sort and a scatter."""
    if x.shape[-1] <= PAIRWISE_RANKS:
        other, this = x[..., None, :], x[..., :, None]  # [..., i, j]: entry j against i
        nan_other, nan_this = jnp.isnan(other), jnp.isnan(this)
        below = (other < this) | (nan_this & ~nan_other)
        equal = (other == this) | (nan_this & nan_other)
        before = jnp.arange(x.shape[-1])[None, :] < jnp.arange(x.shape[-1])[:, None]
        return (below | (equal & before)).sum(-1, dtype=jnp.int32)
    order = jnp.argsort(x, axis=-1)
    place = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    return jnp.put_along_axis(jnp.zeros(x.shape, jnp.int32), order, place, axis=-1, inplace=False)


def best(x: Array, count: Array) -> Array:
    """bool: the `count` (broadcast against x[..., :1]) largest entries of x along
    the last axis, among equals the earlier first, NaN below every number:
    `ranks(-x) < count` without a sort (XLA:CPU's comparison sort of a head's
    thousand candidates costs more than a decode step). The count-th largest is
    found bit by bit in order-preserving integer keys (32 passes, each a count
    of the entries at or above a trial; a pass per two or four bits, counting
    against 3 or 15 trials, timed slower), and the entries equal to it fill what
    the larger ones leave, in order. Subnormal entries keep their order, where
    `ranks(-x)` takes them for zeros (XLA:CPU's sort compares them so)."""
    sign = np.uint32(1 << 31)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    bits = jnp.where(bits == sign, np.uint32(0), bits)  # -0 is 0, as the sort has it
    key = jnp.where(bits >= sign, ~bits, bits | sign)  # by bits: subnormals kept apart
    key = jnp.where(bits & ~sign > np.uint32(0x7F800000), np.uint32(0), key)  # NaN: lowest

    def settle(bit, found):  # found: the count-th largest key's bits above `bit`
        trial = found | jnp.left_shift(np.uint32(1), (31 - bit).astype(jnp.uint32))
        enough = (key >= trial).sum(-1, keepdims=True) >= count
        return jnp.where(enough, trial, found)

    found = jax.lax.fori_loop(0, 32, settle, jnp.zeros((*x.shape[:-1], 1), jnp.uint32))
    larger = key > found
    ties = key == found
    room = count - larger.sum(-1, keepdims=True)
    return larger | (ties & (running_count(ties) <= room))


def position_rank(c: Candidates) -> Array:
    """int32[B, E, C]: each candidate's place in the order of its storage head's
    candidates by (KV head, position): the valid ones 0 .. n - 1, the others after
    them in candidate order. Positions are distinct per KV head and below
    `c.max_len`, so a count over a mark per position ranks them (a cumulative sum
    over max_len: several times cheaper on CPU than a comparison sort of C)."""
    count = c.valid.shape[-1]
    lanes = c.kv_heads if c.valid.shape[1] == 1 else 1  # a pool: its heads one after another
    if not c.max_len:
        key = c.heads * (1 << 24) + c.positions  # positions stay below 2**24
        return ranks(jnp.where(c.valid, key, jnp.iinfo(jnp.int32).max))
    span = lanes * c.max_len
    key = (c.heads if lanes > 1 else 0) * c.max_len + c.positions
    key = jnp.where(c.valid, jnp.clip(key, 0, span - 1), span + jnp.arange(count))
    b = jnp.arange(key.shape[0])[:, None, None]
    e = jnp.arange(key.shape[1])[None, :, None]
    marks = jnp.zeros((*key.shape[:2], span + count), jnp.int32).at[b, e, key].set(1)
    return jnp.take_along_axis(running_count(marks) - 1, key, axis=-1)


def read_artefact(path: str, key: str, shape: str, option: str, fix: str) -> np.ndarray:
    """float32 array `key` of the .npz file at `path`, a calibrated scorer's artefact
    (read once per version of the file); ValueError naming cache.evict.options.<option>
    and `fix` where there is no such file or array of `shape`'s rank, or it is not finite."""
    field = f"cache.evict.options.{option}={path!r}"
    if not path or not os.path.isfile(path):
        raise ValueError(f"{field} names no file: {fix}")
    arrays = read_arrays(path)
    if isinstance(arrays, str) or key not in arrays:
        reason = arrays if isinstance(arrays, str) else f"it holds {sorted(arrays)}"
        raise ValueError(f"{field} is no .npz file with an array {key!r} ({reason}): {fix}")
    array = arrays[key]
    if array.ndim != shape.count(",") + 1 or not np.isfinite(array).all():
        raise ValueError(f"{field} holds {array.shape}, not finite {shape}: {fix}")
    return array


# Scores of calibration contexts per layer, for `global_shares` (an artefact's array
# 'calibration'): L cache layers, R contexts, K KV heads, T tokens each.
CALIBRATION = "[L, R, K, T]"


def global_shares(scores: np.ndarray, keep: float) -> np.ndarray:
    """float64[L]: each layer's share of the kept tokens over the mean (mean 1) when
    each context of `scores` [L, R, K, T] keeps the best `keep` of all its layers'
    tokens together (kvpress's KVzipPress and FastKVzipPress with layerwise=False:
    they prune the int(L K T x (1 - keep)) lowest, ties here by position in the
    layers' order), averaged over the R contexts: Scorer.shares for a method whose
    layers keep unequal shares at the bytes of a uniform budget, measured offline.
    1 everywhere when nothing is pruned, or nothing kept."""
    layers, rows, heads, length = scores.shape
    flat = scores.transpose(1, 0, 2, 3).reshape(rows, -1)
    pruned = int(flat.shape[1] * (1.0 - min(keep, 1.0)))
    if pruned == 0:
        return np.ones(layers)
    lowest = np.argsort(flat, axis=1, kind="stable")[:, :pruned]
    per_layer = np.stack([np.bincount(r // (heads * length), minlength=layers) for r in lowest])
    kept = heads * length - per_layer.mean(0)
    return kept / kept.mean() if kept.any() else np.ones(layers)


def calibrated_shares(
    scores: np.ndarray, first: np.ndarray, evict: Mapping, context: int, layers: int, what: str
) -> tuple[float, ...]:
    """Scorer.shares of a method whose layers keep what all layers' tokens ranked
    together gave calibration contexts (`global_shares`): `scores` [L, R, K, T], the
    positions `first` [T] ranked above every score, at the kept share of
    cache.evict (its budget over `context`, or its ratio); ValueError naming
    `what` (the option and what it holds) for another depth than `layers`."""
    if scores.shape[0] != layers:
        raise ValueError(
            f"{what} of {scores.shape[0]} layer(s), for a model of {layers} cache "
            "layer(s): calibrate them for this model"
        )
    keep = evict["budget"] / context if evict["budget"] else evict["ratio"]
    return tuple(float(s) for s in global_shares(np.where(first, 2.0, scores), keep))


def hash01(x: Array) -> Array:
    """A pseudo-random float in [0, 1) per uint32 (a murmur3 finaliser)."""
    x = x.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return (x >> 8).astype(jnp.float32) / float(1 << 24)


class H2O(Scorer):
    """Heavy hitters (arXiv:2306.14048): the attention a token has received from
    every later query, accumulated over its stay. Option `average`: ranked by
    that sum over the number of queries that saw it (kvpress's
    ObservedAttentionPress; a group of g tokens: its sum over its tokens' counts)."""

    name, observes, keeps, stepwise = "h2o", "all", True, True
    prefix_unsafe = "the attention a cached prefix's tokens accumulated is not in its pages"
    defaults = types.MappingProxyType({"average": False})

    def score(self, c: Candidates) -> Array:
        score = attention(c)
        return score.at[..., : c.held].add(c.state)

    def priority(self, c: Candidates, score: Array) -> Array:
        if not c.options["average"]:
            return score
        g = c.group  # queries at positions p .. end - 1 saw the token at p
        seen = g * (c.end - c.positions) - g * (g - 1) // 2
        return score / jnp.maximum(seen, 1).astype(jnp.float32)


class SnapKV(Scorer):
    """SnapKV (arXiv:2404.14469): the attention of the step's last obs_window
    queries, pooled over `kernel` neighbouring positions: option `pooling`
    'max' (kvlab's default: their summed attention, max-pooled) or 'mean'
    (kvpress's: their mean attention, average-pooled as SnapKV's reference code
    pools, `pooled_mean`; the scale matters where a wrapper adds to it)."""

    name, observes = "snapkv", "window"
    fields = ("recent", "obs_window", "kernel")
    defaults = types.MappingProxyType({"pooling": "max"})

    def check(self, options: Mapping, field: str) -> None:
        if options["pooling"] not in ("max", "mean"):
            raise ValueError(
                f"{field}.pooling={options['pooling']!r} is no pooling {self.name} knows: "
                "set 'max' or 'mean'"
            )

    def score(self, c: Candidates) -> Array:
        if c.options["pooling"] == "max":
            return pooled_max(attention(c), c)
        return pooled_mean(attention(c) / jnp.maximum(c.observed, 1.0), c)


class PyramidKV(SnapKV):
    """PyramidKV (arXiv:2406.02069): SnapKV with budgets shrinking linearly from
    the first layer to the last, whose scored part is the mean's 1 / pyramid_beta."""

    name = "pyramidkv"
    fields = (*SnapKV.fields, "pyramid_beta")

    def budgets(self, budget: int, layers: int, evict: Mapping) -> tuple[int, ...]:
        if layers == 1:
            return (budget,)
        # The scored part (budget - recent) falls linearly from 2m - m/beta in the
        # first layer to m/beta in the last (mean m).
        mean = budget - evict["recent"]
        low = mean / evict["pyramid_beta"]
        high = 2 * mean - low
        step = (high - low) / (layers - 1)
        return tuple(evict["recent"] + max(1, round(high - i * step)) for i in range(layers))


class AdaKV(SnapKV):
    """AdaKV (arXiv:2407.11550): SnapKV's scores, a layer's heads sharing one pool
    (unequal budgets per head, each at least adakv_floor x budget)."""

    name, pooled = "adakv", True
    prefix_unsafe = "its heads share one pool, so a prefix's tokens are not in slot order"
    fields = (*SnapKV.fields, "adakv_floor")


class KNorm(Scorer):
    """K-norm (arXiv:2406.11430): the keys of smallest L2 norm stay (a group: the
    mean of its keys' norms)."""

    name, static = "knorm", True

    def score(self, c: Candidates) -> Array:
        return -jnp.linalg.norm(c.keys(), axis=-1).mean(-1)


class Random(Scorer):
    """A pseudo-random set: a hash of seed, layer, storage head and (first) position."""

    name, static = "random", True
    fields = ("recent", "seed")

    def score(self, c: Candidates) -> Array:
        heads = c.tags.shape[1]
        e = jnp.arange(heads)[None, :, None]
        salt = (c.seed * 0x9E3779B1 + c.layer * 0x85EBCA77) & 0xFFFFFFFF
        return hash01((c.tags * heads + e).astype(jnp.uint32) ^ jnp.uint32(salt))


for _scorer in (H2O(), SnapKV(), PyramidKV(), AdaKV(), KNorm(), Random()):
    SCORERS.register(_scorer)
