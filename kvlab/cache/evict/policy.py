"""Eviction policies: what each layer of an evicting cache keeps (static).

`policies` reads the model and cache sections once, before anything compiles,
into one `Policy` per layer: the method (a scorer of scorers.py, or a window's
ring), its slots per storage head (pyramidkv's per-layer budgets, AdaKV's pool of
K x budget, or groups of g tokens over a quantized layout that settles), what it
always keeps (sinks, recent) and the scorer's options. A budget is a promise: no
head of a scored layer ever holds more tokens than its budget (settled groups and
the unsettled ring together), and `layer_budgets` / `settled_slots` refuse, naming
the fields, budgets that cannot keep it (recent >= budget, a budget above
max_len, a ring that leaves no room for one settled group). The functions below it
are what a policy says about a row of a given length: the position each ring
slot holds, the keys a windowed query sees, the tokens each KV head holds, the
queries whose attention the scorer reads. The layers that apply a policy are
layers.py's EvictingLayer and paged.py's PagedEvictingLayer (docs/caches.md,
"Evicting caches").

Scores: h2o (arXiv:2306.14048) accumulates each token's attention from every
later query; snapkv (arXiv:2404.14469) scores by the attention of the step's
last `obs_window` queries, max-pooled over `kernel` neighbouring positions;
pyramidkv (arXiv:2406.02069) is snapkv with budgets shrinking linearly from the
first layer to the last (the last keeps the mean / pyramid_beta, the mean is
the budget); knorm (arXiv:2406.11430) keeps the keys of smallest L2 norm;
random keeps a pseudo-random set (a hash of seed, layer, head and position).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
from jaxtyping import Array, Int

from kvlab.cache import topology
from kvlab.cache.evict.scorers import Scorer, compose
from kvlab.cache.placement import Placement
from kvlab.cache.quant import Layout, quantized_layout
from kvlab.config import cached_tensors, layer_sections

RING_METHODS = ("window", "sinks")
MAX_SCORED_LEN = 2**24 - 2**16  # positions (and a step's tokens) stay below 2**24: sort keys
# cache.evict.interval=0 (the method's own) for a method defined by one compression:
# batches of a BATCH_SHARE-th of the layer's budget, at most BATCH_STEPS tokens
BATCH_SHARE, BATCH_STEPS = 16, 64


@dataclasses.dataclass(frozen=True)
class Policy:
    """What one evicting layer keeps (static: part of the compiled program)."""

    method: str
    slots: int  # S per storage head (a pooled layer: K x budget); settling: groups of g tokens
    max_len: int  # positions a row may reach: the cache's capacity
    kv_heads: int  # K of the attention (the head tag of a pooled layer)
    query_heads: int  # N
    pooled: bool = False  # adakv over K > 1 heads: one pool per layer
    sinks: int = 0  # ring: first positions kept
    recent: int = 0  # scored: latest positions kept
    obs_window: int = 1
    kernel: int = 1
    floor: int = 0  # adakv: slots each head keeps at least
    seed: int = 0
    layer: int = 0
    residual: int = 0  # quantized: latest tokens kept unsettled, in full precision
    granularity: int = 1  # g: tokens that settle, and are kept or evicted, together
    span: int = 0  # window methods: R, the latest positions a query sees after the sinks
    interval: int = 1  # scored: a full head evicts down to leave interval - 1 tokens free
    #                    (decoding: the decode steps between compressions; method_interval)
    when: str = "every_step"  # cache.evict.when
    budget: int = 0  # after_prefill, decoding: the most tokens a head keeps of a compressed row
    ratio: float = 0.0  # after_prefill with cache.evict.budget 0: the share of it kept
    floor_share: float = 0.0  # adakv_floor (after_prefill: a floor per compressed row)
    options: tuple = ()  # the scorer's options: (name, value) pairs (Candidates.options)
    latent: bool = False  # the first cached tensor is a latent values are read from
    key_channels: int = 0  # channels of each key a slot stores (ThinK); 0: all of them

    @property
    def compresses(self) -> bool:
        """A step given compress=True keeps a row's best `target` tokens per head."""
        return self.when == "after_prefill"

    @property
    def decodes(self) -> bool:
        """cache.evict.when='decoding' (kvpress's DecodingPress): a row's prefill is
        stored whole and every `interval` decode steps (steps of a row that already
        holds tokens) it keeps its best `target` tokens per head; so does a row whose
        tokens would not fit its slots. Its layer counts the steps (`since`)."""
        return self.when == "decoding"

    def target(self, end: Array) -> Array:
        """after_prefill: the tokens each head keeps of rows of `end` tokens (any
        shape): the budget, or floor(ratio x end) (kvpress's
        int(length x (1 - compression_ratio))), at least the `recent` ones. A
        share never outgrows the slots: a context longer than max_len - headroom
        (the budget's) leaves as many fewer tokens to come after it."""
        if self.ratio:
            kept = jnp.floor(end.astype(jnp.float32) * self.ratio).astype(jnp.int32)
        else:
            kept = jnp.full(end.shape, self.budget, jnp.int32)
        return jnp.maximum(kept, self.recent)

    @property
    def spare(self) -> int:
        """Slots a head that overflows frees beyond what the step needs: the
        cache.evict.interval - 1 tokens the next steps then fill without scoring
        (in groups of g; a pool frees its K heads' worth); none while decoding,
        whose interval counts steps instead."""
        if self.decodes:
            return 0
        extra = (self.interval - 1) // self.granularity
        return extra * self.kv_heads if self.pooled else extra

    @property
    def windowed(self) -> bool:
        """A query sees the sinks and its last `span` positions (window, sinks)."""
        return self.method in RING_METHODS

    @property
    def scorer(self) -> Scorer | None:
        """The method's scorer (kvlab/cache/evict/scorers.py); None for a window."""
        return scorer_of(self.method)

    @property
    def keeps(self) -> bool:
        """Whether each slot carries a float32 of the scorer's (`Scorer.keeps`, or
        a static score the layer `remembers`)."""
        return self.scorer is not None and (self.scorer.keeps or self.remembers)

    @property
    def weighs(self) -> bool:
        """Whether each slot carries its token's weight (`Scorer.weighs`: CriticalKV's
        value norm), weighed once as the token arrives: tokens stored one by one
        (a settling layout's groups are weighed at each competition)."""
        s = self.scorer
        return s is not None and s.weighs and not self.ring and not self.settles

    @property
    def competes_always(self) -> bool:
        """A scored layer that competes in every step once its slots are full: every
        step at interval 1, over tokens stored one by one."""
        return (
            self.scorer is not None
            and self.when == "every_step"
            and self.interval == 1
            and not self.settles
        )

    @property
    def remembers(self) -> bool:
        """Whether the layer carries its slots' scores of a `Scorer.static` scorer,
        to score only each step's new tokens: where it `competes_always`, with
        whole keys."""
        return self.competes_always and self.scorer.static and not self.key_channels

    @property
    def buffers(self) -> int:
        """The decode tokens whose queries a decoding layer keeps for its next
        compression (buffer.QueryBuffer): the last obs_window, where its scorer reads
        queries (observes "window" or "all", keeping no state) of a grouped-query
        model; 0 otherwise (a latent's queries meet it without their RoPE part)."""
        s = self.scorer
        if not self.decodes or self.latent or s.keeps or s.observes not in ("window", "all"):
            return 0
        return self.obs_window

    @property
    def probes(self) -> bool:
        """Whether a compressing step's tokens past a row's context are probes
        (Placement.context): observed, never stored (`Scorer.observes` "probes")."""
        return self.scorer is not None and self.scorer.observes == "probes"

    @property
    def peaks(self) -> bool:
        """Whether the mass is each token's largest probability (`Scorer.peaks`)."""
        return self.scorer is not None and self.scorer.peaks

    @property
    def ring(self) -> bool:
        """Slots in a ring whose positions follow from the length (a window over
        tokens stored one by one; over settling groups the newest groups stay)."""
        return self.windowed and not self.settles

    @property
    def settles(self) -> bool:
        """Tokens wait in a full-precision ring and settle in groups (quant.Layout)."""
        return self.residual > 0 or self.granularity > 1

    @property
    def rows(self) -> int:
        """Token rows a row stores per storage head: its slots (settling: g each)."""
        return self.slots * self.granularity

    @property
    def token_rows(self) -> int:
        """Rows each token fills: one per KV head in a pool (each head's copy in a
        slot of its own), else one."""
        return self.kv_heads if self.pooled else 1

    @property
    def layout(self) -> Layout:
        """The quantized layout whose settled(n) rule says when tokens leave the ring."""
        return Layout(self.max_len, self.residual, self.granularity)


def scorer_of(method: str) -> Scorer | None:
    """The scorer of cache.evict.method (wrappers over a scorer: 'chunkkv:snapkv'),
    None for the layouts that score nothing."""
    return None if method in ("none", *RING_METHODS) else compose(method)


def scorer_options(scorer: Scorer, evict: Mapping) -> tuple:
    """The scorer's options, its defaults with cache.evict.options over them, as
    sorted (name, value) pairs (lists as tuples: a Policy is hashed)."""
    given = evict["options"] if "options" in evict else {}
    merged = {**scorer.defaults, **dict(given.items())}
    frozen = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
    return tuple(sorted((name, frozen(value)) for name, value in merged.items()))


def ring_method(model_cfg: Mapping, evict: Mapping) -> tuple[str, int]:
    """(the method, its sinks) a layer of `model_cfg` evicts by: a sliding model's
    ring of its window ('window', or 'sinks' with model.sliding_sinks), else
    cache.evict's method (with cache.evict.sinks for 'sinks')."""
    if model_cfg["sliding_window"]:
        sinks = model_cfg["sliding_sinks"]
        return ("sinks" if sinks else "window"), sinks
    return evict["method"], evict["sinks"] if evict["method"] == "sinks" else 0


def model_ring(model_cfg: Mapping, max_len: int) -> tuple[str, int, int]:
    """(method, sinks, span) of the ring a sliding layer of `model_cfg` caches in a
    cache of `max_len` (its Policy's)."""
    method, sinks = ring_method(model_cfg, {})
    budget = min(model_cfg["sliding_window"] + sinks, max_len)
    return method, sinks, budget - sinks


def resolve_budget(model_cfg: Mapping, cache_cfg: Mapping, max_len: int) -> int:
    """Tokens kept per KV head and layer (before pyramidkv's per-layer schedule). A
    model's sliding window (and its sinks) wider than the cache is the cache's
    length: no position below max_len falls out of it, so the band and the logits
    are the same."""
    if model_cfg["sliding_window"]:
        return min(model_cfg["sliding_window"] + model_cfg["sliding_sinks"], max_len)
    evict = cache_cfg["evict"]
    return evict["budget"] or math.ceil(evict["ratio"] * budget_context(cache_cfg, max_len))


def budget_context(cache_cfg: Mapping, max_len: int) -> int:
    """The tokens cache.evict.ratio is a share of: max_len, the headroom apart
    after_prefill."""
    evict = cache_cfg["evict"]
    if evict["when"] == "after_prefill":
        return max(1, max_len - evict["headroom"])
    return max_len


def layer_budgets(model_cfg: Mapping, cache_cfg: Mapping, max_len: int) -> tuple[int, ...]:
    """Tokens kept per KV head in each layer; raises ValueError for budgets that
    cannot hold what the method always keeps."""
    evict = cache_cfg["evict"]
    method, sinks = ring_method(model_cfg, evict)
    budget = resolve_budget(model_cfg, cache_cfg, max_len)
    layers = topology.num_cache_layers(model_cfg)
    source = (
        "cache.evict.budget" if evict["budget"] else f"ceil(cache.evict.ratio x max_len={max_len})"
    )
    if evict["when"] == "after_prefill" and evict["headroom"] >= max_len:
        raise ValueError(
            f"cache.evict.headroom={evict['headroom']} leaves no room for a context in the "
            f"cache's max_len={max_len}: set cache.evict.headroom below {max_len}"
        )
    if evict["budget"] > max_len and not model_cfg["sliding_window"]:
        raise ValueError(
            f"cache.evict.budget={evict['budget']} is above the cache's max_len={max_len}: "
            "it would allocate more slots than a cache that keeps every token; set "
            f"cache.evict.budget <= {max_len}, or cache.evict.method='none'"
        )
    if method == "sinks" and sinks >= budget and not model_cfg["sliding_window"]:
        raise ValueError(
            f"cache.evict.sinks={sinks} leaves no recent window in a budget of "
            f"{budget} ({source}): set cache.evict.sinks below the budget or a larger budget"
        )
    scorer = scorer_of(method)
    if scorer is None:
        return (budget,) * layers
    context = budget_context(cache_cfg, max_len)
    shares = scorer.shares(layers, evict, context)
    if shares is None:
        budgets = scorer.budgets(budget, layers, evict)
    elif evict["budget"]:
        budgets = tuple(max(1, round(evict["budget"] * s)) for s in shares)
    else:  # the layer's share of the context, as a compression keeps it (`layer_ratios`)
        budgets = tuple(max(1, math.ceil(r * context)) for r in layer_ratios(evict, shares))
    least = min(budgets)
    if evict["recent"] >= least:
        where = f" in layer {budgets.index(least)}" if shares is not None else ""
        raise ValueError(
            f"cache.evict.recent={evict['recent']} keeps every token of a budget of {least}"
            f"{where} ({source}), so nothing is scored: set cache.evict.recent below the "
            "budget, or use cache.evict.method='window'"
        )
    # A layer never holds more than max_len tokens: slots past it (pyramidkv's first
    # layers) would be bytes that change nothing.
    return tuple(min(b, max_len) for b in budgets)


def layer_ratios(evict: Mapping, shares: tuple[float, ...] | None) -> tuple[float, ...] | None:
    """Each layer's share of a row's context (cache.evict.ratio x the layer's
    share of the budget, `Scorer.shares`, at most 1), or None where every layer
    keeps the ratio."""
    if shares is None:
        return None
    # A layer keeps at most its whole context (DuoAttention's layer of retrieval heads).
    return tuple(min(1.0, evict["ratio"] * s) for s in shares)


def policies(
    model_cfg: Mapping, cache_cfg: Mapping, max_len: int
) -> tuple[Policy | None, ...] | None:
    """One Policy per cache layer, or None for a cache that keeps every token. A
    hybrid model (model.layer_types) has a window policy for each sliding layer and,
    for each full layer, cache.evict's policy, or None where it keeps every token:
    each kind's layers are planned as a model whose layers are all of that kind
    (kvlab.config.layer_sections), so a per-layer schedule (pyramidkv) follows a
    layer's depth in the whole stack."""
    kinds = layer_sections(model_cfg, cache_cfg)
    if len(kinds) == 1:
        return _policies(model_cfg, cache_cfg, max_len)
    plans = {w: _policies(m, c, max_len) for w, (m, c) in kinds.items()}
    return tuple(
        None if plans[w] is None else plans[w][i]
        for i, w in enumerate(topology.cache_windows(model_cfg))
    )


def _policies(model_cfg: Mapping, cache_cfg: Mapping, max_len: int) -> tuple[Policy, ...] | None:
    """`policies` for a model whose layers are alike."""
    evict = cache_cfg["evict"]
    method, sinks = ring_method(model_cfg, evict)
    if method == "none":
        return None
    scorer = scorer_of(method)
    if scorer is not None and max_len > MAX_SCORED_LEN:
        raise ValueError(
            f"max_len={max_len} is too long for cache.evict.method={method!r}: scored slots "
            f"key positions below 2**24 with their head; use max_len <= {MAX_SCORED_LEN}"
        )
    grouped = model_cfg["attention"] != "mla"
    kv_heads = model_cfg["num_kv_heads"] if grouped else 1
    pooled = scorer is not None and scorer.pooled and kv_heads > 1
    floored = pooled and "adakv_floor" in scorer.fields  # AdaKV's floor; other pools have none
    # Quantized with a residual window or per-channel scales (KIVI): tokens settle in
    # groups of g and only settled groups compete, for the slots settled_slots allows.
    layout = quantized_layout(model_cfg, cache_cfg, max_len)
    residual, g = (0, 1) if layout is None else (layout.residual, layout.granularity)
    settles = residual > 0 or g > 1
    compresses = evict["when"] == "after_prefill" and scorer is not None
    decodes = evict["when"] == "decoding" and scorer is not None
    if scorer is not None and scorer.observes == "probes" and not compresses:
        raise ValueError(
            f"cache.evict.method={method!r} scores a context by the probes fed after it "
            "in the step that compresses it: set cache.evict.when='after_prefill'"
        )
    if scorer is not None and scorer.reads_hidden and settles:
        raise ValueError(
            f"cache.evict.method={method!r} scores each token by its hidden state as it "
            "arrives, and this quantized layout settles tokens in groups later "
            "(cache.residual > 0 or per-channel scales): set cache.residual=0 and "
            "cache.<prefix>_axis='token', or another method"
        )
    options = () if scorer is None else scorer_options(scorer, evict)
    key_channels = _key_channels(scorer, model_cfg, cache_cfg, dict(options), pooled, settles)
    if compresses or decodes:
        _check_compression(method, evict, settles)
    shared = None if evict["budget"] or not compresses else evict["ratio"]
    ratios = None
    if shared is not None:
        layers = topology.num_cache_layers(model_cfg)
        shares = scorer.shares(layers, evict, budget_context(cache_cfg, max_len))
        ratios = layer_ratios(evict, shares)
    out = []
    for i, budget in enumerate(layer_budgets(model_cfg, cache_cfg, max_len)):
        interval = method_interval(scorer, evict, budget)
        if compresses:  # the compressed context and the tokens after it
            units = min(budget + evict["headroom"], max_len)
        elif decodes:  # a prompt stored whole, and the steps until it is compressed
            units = min(budget + evict["headroom"] + interval - 1, max_len)
        elif not settles:
            units = budget
        elif method in RING_METHODS:
            units = window_groups(layout, sinks, budget - sinks)
        else:
            units = settled_slots(layout, budget, i)
        out.append(
            Policy(
                method=method,
                slots=units * kv_heads if pooled else units,
                max_len=max_len,
                kv_heads=kv_heads,
                query_heads=model_cfg["num_heads"],
                pooled=pooled,
                sinks=sinks,
                recent=evict["recent"] if scorer is not None else 0,
                obs_window=evict["obs_window"],
                kernel=evict["kernel"],
                floor=math.floor(evict["adakv_floor"] * units) if floored else 0,
                seed=evict["seed"],
                layer=i,
                residual=residual if settles else 0,
                granularity=g if settles else 1,
                span=budget - sinks if method in RING_METHODS else 0,
                interval=interval,
                when=evict["when"] if compresses or decodes else "every_step",
                budget=budget,
                ratio=(shared or 0.0) if ratios is None else ratios[i],
                floor_share=evict["adakv_floor"] if floored else 0.0,
                options=options,
                latent=not grouped,
                key_channels=key_channels,
            )
        )
        if not evict["interval"] and not out[-1].decodes:  # the method's own, as the layer allows
            out[-1] = dataclasses.replace(
                out[-1], interval=max(1, min(interval, _most_interval(out[-1], evict)))
            )
        _check_interval(out[-1], evict)
    shared = topology.num_cache_layers(model_cfg) < model_cfg["num_layers"]
    if out and out[0].buffers and shared:
        raise ValueError(
            f"cache.evict.method={method!r} with cache.evict.when='decoding' scores each "
            "compression by one attention's buffered queries, and model.topology="
            f"{model_cfg['topology']!r} has several layers read one cache layer: use "
            "cache.evict.when='after_prefill', a method that reads no queries, or no topology"
        )
    return tuple(out)


def _key_channels(scorer, model_cfg, cache_cfg, options, pooled: bool, settles: bool) -> int:
    """The channels each stored key keeps under a wrapper that prunes them (ThinK),
    0 when it keeps all; refuses the storage such keys cannot live in."""
    if scorer is None:
        return 0
    width = cached_tensors(model_cfg)[0].width
    kept = scorer.key_channels(width, options)
    if kept >= width:
        return 0
    method = cache_cfg["evict"]["method"]
    refused = [
        (scorer.observes == "probes", "compresses by probes (a row's first write may see none)"),
        (pooled, "pools its heads' slots (one pool reads every head's channels)"),
        (cache_cfg["k_bits"] < 16, f"has quantized keys (cache.k_bits={cache_cfg['k_bits']})"),
        (settles, "settles tokens in groups (cache.residual > 0 or per-channel scales)"),
    ]
    for refuses, why in refused:
        if refuses:
            raise ValueError(
                f"cache.evict.method={method!r} stores pruned keys, which a cache that {why} "
                "cannot hold: prune keys over a scorer with its own slots per head in a "
                "dense cache with 16-bit keys, or drop the pruning wrapper"
            )
    return kept


def _check_compression(method: str, evict: Mapping, settles: bool) -> None:
    """Refuses what cache.evict.when='after_prefill' or 'decoding' cannot compress exactly."""
    if settles:
        raise ValueError(
            f"cache.evict.when={evict['when']!r} cannot compress a quantized layout whose "
            "tokens settle in groups (cache.residual > 0 or per-channel scales): set "
            "cache.residual=0 and cache.<prefix>_axis='token', or cache.evict.when='every_step'"
        )
    if method == "pyramidkv" and not evict["budget"]:
        raise ValueError(
            "cache.evict.method='pyramidkv' with cache.evict.when='after_prefill' needs "
            "cache.evict.budget: its per-layer budgets are fixed when the cache is built, "
            "so they cannot follow a share (cache.evict.ratio) of each row's context"
        )


def method_interval(scorer: Scorer | None, evict: Mapping, budget: int) -> int:
    """A layer's interval (before `_most_interval` bounds the method's own):
    cache.evict.interval, or where it is 0 (the default) the method's own, 1 for
    a window, a compression after prefill or a scorer whose definition evicts at
    every step (`Scorer.stepwise`); else a batch: budget / BATCH_SHARE tokens, at
    most BATCH_STEPS. A method defined by one compression (SnapKV, KNorm, ...)
    then scores once per batch instead of once per step (kvpress batches its
    DecodingPress by 512 steps), and a head between compressions holds at least
    budget - interval + 1 of its budget's tokens."""
    if evict["interval"]:
        return evict["interval"]
    if scorer is None or scorer.stepwise or evict["when"] == "after_prefill":
        return 1
    return max(1, min(BATCH_STEPS, budget // BATCH_SHARE))


def _most_interval(policy: Policy, evict: Mapping) -> int:
    """The largest interval whose spare slots leave a head what the layer always
    keeps (its recent tokens, AdaKV's floor): the bound `_check_interval` names."""
    units, always = _units_kept_always(policy, evict)
    return (units - always) * policy.granularity + 1


def _units_kept_always(policy: Policy, evict: Mapping) -> tuple[int, int]:
    """(slots per head, of which always kept: the recent tokens' and the floor)."""
    g = policy.granularity
    units = policy.slots // policy.kv_heads if policy.pooled else policy.slots
    always = evict["recent"] if g == 1 else -(-evict["recent"] // g) + 1
    return units, max(always, policy.floor)


def _check_interval(policy: Policy, evict: Mapping) -> None:
    """Refuses an interval whose spare slots would have to come out of what the
    layer always keeps (its recent tokens, AdaKV's floors)."""
    if policy.interval == 1 or policy.decodes:
        return
    units, always = _units_kept_always(policy, evict)
    spare = (policy.interval - 1) // policy.granularity
    if spare + always > units:
        raise ValueError(
            f"cache.evict.interval={policy.interval} frees {spare} slot(s) of layer "
            f"{policy.layer}'s {units} per head beyond each step's need, but {always} always "
            f"stay (cache.evict.recent={evict['recent']}, adakv_floor, "
            f"cache.group_size={policy.granularity}): set cache.evict.interval to at most "
            f"{_most_interval(policy, evict)}, or a larger budget"
        )


def settled_slots(layout: Layout, budget: int, layer: int = 0) -> int:
    """Group slots per head of a scored layer over a settling layout: the most
    whose settled groups plus the unsettled ring never hold more than `budget`
    tokens at any length (a row holds min(u x g, settled(n)) + n - settled(n) at
    length n); ValueError when not even one group fits beside the ring."""
    g, residual = layout.granularity, layout.residual

    def most_held(units: int) -> int:
        # Until settled(n) exceeds the slots a row holds all n tokens; after it, the
        # slots and the ring, whose fill repeats with period g: g lengths cover it.
        first = units * g + g + residual  # the first length that evicts
        lengths = range(first, min(first + g, layout.capacity + 1))
        evicting = (units * g + n - layout.settled(n) for n in lengths)
        return max([min(first - 1, layout.capacity), *evicting])

    units = min(budget // g, layout.payload_len // g)
    while units > 0 and most_held(units) > budget:
        units -= 1
    if units == 0:
        raise ValueError(
            f"a budget of {budget} tokens (layer {layer}) cannot hold one settled group of "
            f"cache.group_size={g} beside the unsettled ring of up to {layout.ring_len} tokens "
            f"(cache.residual={residual}): set cache.evict.budget (or ratio) to at least "
            f"{layout.ring_len + g}, or a smaller cache.residual"
        )
    return units


def window_groups(layout: Layout, sinks: int, span: int) -> int:
    """Group slots a window over settling groups needs: the groups holding the
    first `sinks` positions, and enough of the newest settled ones that every
    query sees its last `span` positions (the rest of them are unsettled)."""
    g = layout.granularity
    sink_groups = -(-sinks // g)
    needed = 1
    # Queries at position n (the first of a step at length n) reach back to
    # n - span + 1; which groups are settled repeats with period g past the start.
    for n in range(min(layout.capacity, sinks + span + layout.residual + 3 * g) + 1):
        reach = max(0, n - span + 1) // g
        needed = max(needed, layout.settled(n) // g - max(reach, sink_groups))
    return sink_groups + needed


def storage_heads(policy: Policy) -> int:
    """E: heads that evict on their own (1 for a pooled or latent layer)."""
    return 1 if policy.pooled else policy.kv_heads


# ---------------------------------------------------------------------------
# What a policy says about a row: the ring, the band, the tokens held, the queries observed


def ring_positions(lengths: Int[Array, " B"], policy: Policy) -> Int[Array, "B S"]:
    """The position each ring slot holds for rows of `lengths` tokens; -1 = empty."""
    slot = jnp.arange(policy.slots)
    sinks, span = policy.sinks, policy.span
    last = lengths[:, None] - 1
    offset = slot - sinks  # place in the ring after the sinks
    latest = sinks + offset + span * jnp.floor_divide(last - sinks - offset, span)
    in_ring = last - sinks - offset >= 0
    position = jnp.where(slot < sinks, slot, latest)
    held = jnp.where(slot < sinks, slot < lengths[:, None], in_ring)
    return jnp.where(held, position, -1)


def banded(q_positions: Array, k_positions: Array, sinks: int, span: int) -> Array:
    """Keys a query may see under a window of `span` positions after `sinks` kept ones."""
    return (
        (k_positions >= 0)
        & (k_positions <= q_positions)
        & ((k_positions < sinks) | (k_positions > q_positions - span))
    )


def stored_tokens(positions: Array | None, policy: Policy, lengths: Array) -> Array:
    """int32[B, K]: tokens each KV head of each row holds (K = 1 for a latent)."""
    if policy.ring:
        return jnp.minimum(lengths, policy.slots)[:, None]
    held = positions >= 0  # [B, E, S]
    if policy.pooled:  # [B, 1, S] -> per KV head [B, K]
        heads = jnp.arange(policy.kv_heads)[None, :, None]
        held = held & (positions % policy.kv_heads == heads)
    count = held.sum(-1)
    if policy.settles:  # kept groups of g tokens, and the ring's unsettled tokens
        count = count * policy.granularity + (lengths - policy.layout.settled(lengths))[:, None]
    return count.astype(jnp.int32)


def observed_queries(policy: Policy, placement: Placement) -> Array | None:
    """float32[B, T]: the queries whose attention the scorer reads (`observes`:
    "all" real ones, the last obs_window of a "window", the "last" one, the
    "probes" past a compressing row's context), or None (a step without
    probes: the attention computes no mass)."""
    observes = None if policy.scorer is None else policy.scorer.observes
    if observes is None:
        return None
    steps = jnp.arange(placement.positions.shape[1])[None, :]
    real = steps < placement.num_tokens[:, None]
    if observes == "probes":
        if placement.context is None:  # no probes this step: nothing observed
            return None
        probe = placement.positions >= placement.context[:, None]
        return (real & probe & (placement.context[:, None] > 0)).astype(jnp.float32)
    if observes != "all":
        window = policy.obs_window if observes == "window" else 1
        real = real & (steps >= placement.num_tokens[:, None] - window)
    return real.astype(jnp.float32)


def overflows(
    positions: Array | None, policy: Policy, placement: Placement, since: Array | None = None
) -> Array | bool | None:
    """bool[]: whether a step's candidates (the held slots and the step's new
    tokens, or the groups that settle in it) outnumber some head's slots in some
    row, so the write competes and its scorer reads the mass; the same count the
    write makes (a decoding layer's: a row it compresses, `due`, given its count
    `since`). None where the scorer's mass is needed every step (`keeps`), or is
    once the slots are full (`competes_always`: a step choosing between attention
    with and without the mass costs more there than the mass of the steps that
    fill the slots). False where no step reads it: a wrapper observes for the
    queries alone, over a scorer that reads no mass (criticalkv:knorm)."""
    if policy.scorer is not None and not policy.scorer.reads_mass:
        return False
    if policy.scorer is None or policy.keeps:  # a window, or h2o
        return None
    if policy.competes_always:
        return None
    compressing = False
    if policy.compresses and placement.compress is not None:
        compressing = jnp.any(placement.compress & (placement.num_tokens > 0))
    if policy.decodes:
        compressing = jnp.any(due(since, positions, policy, placement))
    return jnp.any(rows_overflow(positions, policy, placement)) | compressing


def rows_overflow(positions: Array, policy: Policy, placement: Placement) -> Array:
    """bool[B]: rows with a head whose held slots and the step's new tokens (or the
    groups that settle in it) outnumber its slots."""
    held = (positions >= 0).sum(-1)  # [B, E]
    new = placement.num_tokens
    if policy.settles:
        layout, lengths = policy.layout, placement.lengths
        new = (layout.settled(lengths + new) - layout.settled(lengths)) // policy.granularity
    if policy.pooled:
        new = new * policy.kv_heads
    return jnp.any(held + new[:, None] > positions.shape[2], axis=-1)


def due(since: Array, positions: Array, policy: Policy, placement: Placement) -> Array:
    """bool[B]: rows a decoding layer (Policy.decodes) compresses in this step: a
    decode step (a row that holds tokens is given more) that is the `interval`-th
    since the row last compressed or brings at least the budget's tokens (kvpress's
    DecodingPress: compression_interval, q_len >= target_size), and any row whose
    tokens would not fit its slots (a prompt longer than the budget and headroom)."""
    real = placement.num_tokens > 0
    decoding = real & (placement.lengths > 0)
    count = decoding & ((since + 1 >= policy.interval) | (placement.num_tokens >= policy.budget))
    return count | (real & rows_overflow(positions, policy, placement))


def steps_since(since: Array, compressed: Array, placement: Placement) -> Array:
    """int32[B]: a decoding layer's count of decode steps after this step: 0 where
    it compressed, one more where it decoded."""
    decoding = (placement.num_tokens > 0) & (placement.lengths > 0)
    return jnp.where(compressed, 0, since + decoding.astype(jnp.int32))


def empty_slots(policy: Policy, batch: int):
    """(positions, scores) of a layer that holds nothing: -1 and 0 per slot of each
    storage head [B, E, S] (scores only where the scorer keeps them); (None, None) for a ring."""
    if policy.ring:
        return None, None
    shape = (batch, storage_heads(policy), policy.slots)
    scores = jnp.zeros(shape, jnp.float32) if policy.keeps else None
    return jnp.full(shape, -1, jnp.int32), scores


def empty_weights(policy: Policy, batch: int) -> Array | None:
    """float32[B, E, S] zeros: the weight each slot's token carries where the
    layer `weighs` its tokens; None otherwise."""
    if not policy.weighs:
        return None
    return jnp.zeros((batch, storage_heads(policy), policy.slots), jnp.float32)


def empty_since(policy: Policy, batch: int) -> Array | None:
    """int32[B] zeros: a decoding layer's count of decode steps since each row
    last compressed (Policy.decodes); None for other policies."""
    return jnp.zeros((batch,), jnp.int32) if policy.decodes else None


def empty_ring_scores(policy: Policy, batch: int) -> Array | None:
    """float32[B, K, W] zeros where a settling layer's scorer keeps its ring's tokens'
    scores (h2o), else None."""
    if not (policy.settles and policy.keeps):
        return None
    return jnp.zeros((batch, policy.kv_heads, policy.layout.ring_len), jnp.float32)
