"""Perplexity and recall through a cache: what generation with that cache sees,
and how far its next-token distributions move from a reference cache's.

    result = kvlab.eval.evaluate(model_cfg, cache_cfg, params, batches, chunk=32)
    result = kvlab.eval.evaluate(..., reference=full_cache(cache_cfg))   # + KL to the full cache
    reference = kvlab.eval.evaluate_reference(model_cfg, full_cache(c), params, batches, chunk=32)
    result = kvlab.eval.evaluate(model_cfg, cache_cfg, params, batches, chunk=32,
                                 reference=reference)                     # its logits reused

Each held-out window of T tokens goes through a fresh cache of capacity T in
prefill chunks of `chunk` tokens: every chunk attends to the tokens already in
the cache as the cache stores them (quantized, latent, ...), exactly as a
decode step would, and its logits are scored against the next tokens. Cached
storage is chunk-invariant (kvlab/cache/quant/), so any chunk size gives the
logits token-by-token decoding gives; larger chunks are only faster. With a
16-bit dense cache the result equals the plain forward's. With `prefill=P` each
window's first P tokens go in as one step (a prompt prefilled whole) and the rest
in chunks of `chunk`: the protocol of caches whose logits depend on the steps,
such as a topology that fits a row's bases from its first step or reads a step's
own tokens uncoded (kvlab/cache/topology; `chunk=1` decodes after the prompt).

The result holds loss (nats per target), ppl, bits_per_token (bits per
target), bits_per_byte (per UTF-8 byte of the text the targets cover: the
batches' `target_bytes` with data.tokenizer, else a target is a byte and it
equals bits_per_token), accuracy (argmax hits; MQAR's metric),
targets (how many were scored) and the cache's bytes per token: analytic
(`cache_bytes` of one sequence of T tokens over T), measured (`tree_bytes`
of that cache over T) and long (what each further token adds to a long cache,
without the fixed full-precision window).

With a reference (the same model's full cache, `full_cache`: every tensor at
16 bits, every token kept) the result adds, over the scored (weighted) targets:
kl_mean, the weighted mean of KL(P_reference || P_cache) of the next-token
distributions (nats), kl_p99, its 99th percentile over the tokens of nonzero
weight, top1_agreement, the weighted share of tokens whose argmax is the
reference's, and delta_ppl = ppl - the reference's ppl. Both caches' logits go
through one float32 log-softmax (stacked), so identical logits give exactly
kl 0, agreement 1 and delta 0, and the reference scores exactly that against
itself.

With `windows=True` the result also holds `windows`: per evaluation window
(each row of each batch, batches in order) the sums {"nll", "correct",
"weight"} its targets add (float32 per chunk, added up in float64), so a
caller can resample windows (kvlab.sweep's bootstrap over seeds and windows);
ppl is exp(sum nll / sum weight) over all of them. Off by default: the result
stays a dict of numbers.

The reference costs one evaluation per model, not one per cache:
`evaluate_reference` runs it once and keeps its logits per window and chunk on
the devices, laid out as its rows were (float32[B, C, V]; 8 MiB for the tiny
sweeps' 4 windows of 16 x 128 bytes), and every `evaluate(reference=...)`
scores its own logits against them. Where the logits of all windows would
exceed KEEP_REFERENCE_BYTES (large vocabularies, long windows) it keeps none,
and each evaluation runs the reference cache in lockstep with its own (twice
the forward passes, no memory). A reference remembers the model, batches,
chunk, prefill and mesh it ran with and refuses other batches, steps or mesh, and a
model whose parameters differ in names or shapes: another model with the same
parameters (a model made hybrid by model.layer_types, another rope scaling or
attention_impl) is scored against the reference's, which the lockstep runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from kvlab import sharding
from kvlab.cache import cache_bytes, init_cache, tree_bytes
from kvlab.config import CACHED_PREFIXES, check_count, frozen, validate_cache_config
from kvlab.model import Transformer, init_params
from kvlab.sampling import place_params
from kvlab.train import score, summarize, target_bytes

# Above this many bytes of reference logits (all windows, float32) a reference
# keeps none and runs in lockstep with each cache it scores.
KEEP_REFERENCE_BYTES = 1 << 30


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _score_chunk(model: Transformer, params, cache, inputs, targets, weights):
    logits, cache = model.apply({"params": params}, inputs, cache=cache)
    return cache, score(logits, targets, weights)


_score = jax.jit(score)


@jax.jit
def _row_sums(logits, targets, weights) -> dict:
    """Per-row sums float32[B] of one chunk's nll, argmax hits and weights, from
    its logits [B, C, V]: a program of its own, so asking for windows leaves the
    numbers of every other program as they were."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "nll": jnp.sum(nll * weights, axis=1),
        "correct": jnp.sum(hits * weights, axis=1),
        "weight": jnp.sum(weights, axis=1),
    }


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def chunk_logits(model: Transformer, params, cache, inputs):
    """(logits float32[B, C, V], cache) of one chunk: the one program a cache
    config runs, whether it is the reference or the cache compared with it."""
    logits, cache = model.apply({"params": params}, inputs, cache=cache)
    return logits, cache


@jax.jit
def compare_logits(logits, reference, targets, weights) -> tuple[dict, jax.Array]:
    """(sums, per-token KL float32[B, C]) of a cache's `logits` against the
    `reference` cache's (both [B, C, V]) at `targets` int32[B, C] with
    `weights` float32[B, C].

    sums, weighted: nll, correct and weight as train.score counts them (from
    the log-softmax below), reference_nll, kl (KL(P_reference || P_cache) in
    nats) and agree (argmax equal). Identical logits give kl exactly 0 and agree
    equal to weight."""
    # [2, B, C, V]: one log-softmax for both, so equal rows give equal log-probs
    logp = jax.nn.log_softmax(jnp.stack([reference, logits]).astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[None, :, :, None], axis=-1)[..., 0]  # [2, B, C]
    nll = jnp.sum(nll * weights, axis=(1, 2))  # [2]
    top1 = jnp.argmax(logp, axis=-1)  # [2, B, C]
    # sum_v p (log p - log q): every term is exactly 0 where the rows are equal
    kl = jnp.sum(jnp.exp(logp[0]) * (logp[0] - logp[1]), axis=-1)  # [B, C]
    kl = jnp.maximum(kl, 0.0)  # rounding may take a near-equal pair just below 0
    sums = {
        "nll": nll[1],
        "reference_nll": nll[0],
        "correct": jnp.sum((top1[1] == targets) * weights),
        "weight": jnp.sum(weights),
        "kl": jnp.sum(kl * weights),
        "agree": jnp.sum((top1[0] == top1[1]) * weights),
    }
    return sums, kl


def cache_bytes_per_token(model_cfg: Mapping, cache_cfg: Mapping, seq_len: int) -> dict:
    """Bytes per token of one sequence's cache holding `seq_len` tokens.

    `cache_bytes_per_token` (analytic) and `..._measured` (the leaves of a
    real cache) include everything stored for the sequence: payloads, scales,
    zero points, the full-precision residual window and the length counter.
    `..._long` is what each further token adds to a long cache.
    """
    analytic = cache_bytes(model_cfg, cache_cfg, batch_size=1, seq_len=seq_len)
    measured = tree_bytes(jax.eval_shape(lambda: init_cache(model_cfg, cache_cfg, 1, seq_len)))
    # Far from the start, a token adds its payload and its share of the scales;
    # the full-precision window and a partly filled group are a fixed cost.
    short, long = 1024 * cache_cfg.group_size, 2048 * cache_cfg.group_size
    growth = cache_bytes(model_cfg, cache_cfg, 1, long) - cache_bytes(
        model_cfg, cache_cfg, 1, short
    )
    return {
        "cache_bytes_per_token": analytic / seq_len,
        "cache_bytes_per_token_measured": measured / seq_len,
        "cache_bytes_per_token_long": growth / (long - short),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
    """A cache evaluated once to score others against (`evaluate_reference`).

    model_cfg, cache_cfg: the frozen sections it ran; chunk, prefill, mesh, rules: how
    (mesh None: one device); batches: a digest of the batches' shapes and
    values; result: its own evaluate() result (kl_mean 0, kl_p99 0,
    top1_agreement 1, delta_ppl 0); logits: per window, per chunk, its logits
    float32[B, C, V] on the devices, or None: too many to keep
    (KEEP_REFERENCE_BYTES), so each evaluation runs the reference cache in
    lockstep with its own.
    """

    model_cfg: ml_collections.FrozenConfigDict
    cache_cfg: ml_collections.FrozenConfigDict
    chunk: int
    prefill: int
    mesh: Mesh | None
    rules: tuple | None
    batches: str
    result: dict
    logits: list | None


def _digest(batches: Sequence[Mapping]) -> str:
    """sha1 of the batches' inputs, targets and weights (shapes and values)."""
    digest = hashlib.sha1()
    for batch in batches:
        for key in ("inputs", "targets", "weights"):
            value = np.ascontiguousarray(batch[key])
            digest.update(f"{key}{value.shape}{value.dtype}".encode())
            digest.update(value.tobytes())
    return digest.hexdigest()


def _validated_reference(cache_cfg: Mapping, model_cfg: Mapping) -> None:
    try:
        validate_cache_config(cache_cfg, model_cfg)
    except ValueError as error:
        raise ValueError(
            f"the reference cache (reference=) is invalid for this model: {error}; pass "
            "the model's full cache, kvlab.eval.full_cache(cache_cfg)"
        ) from None


def _check_reference(reference: Reference, model: Transformer, batches, steps, mesh, rules):
    """Raises ValueError when `reference` ran another model, batches, steps ((chunk,
    prefill)) or mesh."""
    fix = (
        "build it with evaluate_reference on the same model, params, batches, chunk, "
        "prefill and mesh"
    )
    if reference.model_cfg != model.config and _parameters(reference.model_cfg) != _parameters(
        model.config
    ):
        theirs, ours = reference.model_cfg.to_dict(), model.config.to_dict()
        field = next(k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
        raise ValueError(
            f"reference= ran a model with other parameters: model.{field}="
            f"{theirs.get(field)!r} there, {ours.get(field)!r} here; {fix}"
        )
    ran = {"chunk": (reference.chunk, steps[0]), "prefill": (reference.prefill, steps[1])}
    ran["mesh"] = (reference.mesh, mesh)
    ran["mesh rules"] = (reference.rules, rules)
    ran["batches (tokens or weights)"] = (reference.batches, _digest(batches))
    for name, (theirs, ours) in ran.items():
        if theirs != ours:
            shown = "" if name.startswith("batches") else f": {theirs!r} there, {ours!r} here"
            raise ValueError(f"reference= ran with other {name}{shown}; {fix}")


@functools.lru_cache(maxsize=16)
def _parameters(model_cfg: ml_collections.FrozenConfigDict):
    """The names, shapes and dtypes of a model's parameters (nothing computed)."""
    shapes = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    return jax.tree.structure(shapes), tuple((x.shape, x.dtype) for x in jax.tree.leaves(shapes))


def _placed(model: Transformer, params, mesh: Mesh | None, rules: tuple | None):
    """(mesh, rules, params placed on the mesh); (None, None, params) for one device."""
    if mesh is None or mesh.size == 1:
        return None, None, params  # rules mean nothing without a mesh
    rules = sharding.axis_rules() if rules is None else rules
    return mesh, rules, place_params(model.config, params, mesh, rules)


def _run(
    model,
    cache_cfg,
    params,
    batches,
    steps,
    mesh,
    rules,
    *,
    compare,
    reference,
    keep,
    per_row=False,
):
    """Every window through `cache_cfg` in `steps` ((chunk, prefill): `spans`);
    returns (per-chunk sums, per-window
    per-token KL [B, T] or None, per-window kept logits or None, seq_len,
    per-batch lists of each chunk's per-row sums [B] on the devices, or None).

    compare False: score() alone (no reference). Else each chunk's logits are
    compared with the reference's: `reference` None (the cache is its own
    reference), a Reference holding logits, or one without (run in lockstep).
    keep: return this cache's logits per window and chunk, on the devices.
    per_row: also sum each row of each chunk (_row_sums)."""
    scored, tokens, kept, rows_of = [], [], [], []
    lockstep = reference is not None and reference.logits is None
    if lockstep:  # the reference's model (its parameters are these)
        ref_model = (
            model if reference.model_cfg == model.config else Transformer(reference.model_cfg)
        )
    seq_len = None
    for window, batch in enumerate(batches):
        size, seq_len = batch["inputs"].shape
        cache = init_cache(model.config, cache_cfg, size, seq_len, mesh=mesh, rules=rules)
        if lockstep:
            ref_cache = init_cache(
                ref_model.config, reference.cache_cfg, size, seq_len, mesh=mesh, rules=rules
            )
        if mesh is not None:  # this host's rows of the batch, as training reads them
            placed = sharding.batch_sharding(mesh, rules, size)
            host_rows = sharding.process_rows(placed, size)
        window_kl, window_logits, window_rows = [], [], []
        for index, (start, stop) in enumerate(spans(seq_len, *steps)):
            part = {k: batch[k][:, start:stop] for k in ("inputs", "targets", "weights")}
            if mesh is not None:
                part = {
                    k: sharding.rows_array(v[host_rows], host_rows, size, placed)
                    for k, v in part.items()
                }
            inputs, targets, weights = part["inputs"], part["targets"], part["weights"]
            if not compare and not per_row:
                cache, sums = _score_chunk(model, params, cache, inputs, targets, weights)
                scored.append(sums)
                continue
            logits, cache = chunk_logits(model, params, cache, inputs)
            if per_row:  # [B], laid out by rows: fetched at the end
                window_rows.append(_row_sums(logits, targets, weights))
            if not compare:
                scored.append(_score(logits, targets, weights))
                continue
            if reference is None:
                against = logits
            elif lockstep:
                against, ref_cache = chunk_logits(ref_model, params, ref_cache, inputs)
            else:
                against = reference.logits[window][index]
            sums, kl = compare_logits(logits, against, targets, weights)
            scored.append(sums)
            window_kl.append(kl)
            if keep:
                window_logits.append(logits)
        cache.check()  # after each window: a flag names the rows it was given bad values
        if lockstep:
            ref_cache.check()
        tokens.append(window_kl)
        kept.append(window_logits)
        rows_of.append(window_rows)
    compared, kept = (tokens if compare else None), (kept if keep else None)
    return scored, compared, kept, seq_len, rows_of if per_row else None


def spans(seq_len: int, chunk: int, prefill: int = 0) -> list[tuple[int, int]]:
    """(start, stop) of each step through a window of `seq_len` tokens: its first
    `prefill` tokens in one, then chunks of `chunk` (the last may be shorter)."""
    first = min(prefill, seq_len)
    rest = [(s, min(s + chunk, seq_len)) for s in range(first, seq_len, chunk)]
    return ([(0, first)] if first else []) + rest


def _window_sums(rows_of: list) -> list[dict]:
    """{"nll", "correct", "weight"} per row of each batch (batches in order)
    from each chunk's per-row sums, gathered whole on every host."""
    windows = []
    for chunks in rows_of:
        totals = {
            key: np.sum([sharding.fetch(part[key]) for part in chunks], axis=0, dtype=np.float64)
            for key in ("nll", "correct", "weight")
        }
        windows += [
            {key: float(values[row]) for key, values in totals.items()}
            for row in range(len(totals["weight"]))
        ]
    return windows


def loss_change(result: Mapping, base: Mapping) -> tuple[float, float]:
    """The mean over windows of each window's change in mean loss from `base` to
    `result` (both evaluated with windows=True on the same batches) and the
    half-width of its normal 95% interval (nats)."""
    if len(result["windows"]) != len(base["windows"]) or len(result["windows"]) < 2:
        raise ValueError(
            f"loss_change needs two results over the same windows (at least 2); got "
            f"{len(result['windows'])} and {len(base['windows'])}: evaluate both with "
            "windows=True on the same batches"
        )
    change = [
        w["nll"] / w["weight"] - b["nll"] / b["weight"]
        for w, b in zip(result["windows"], base["windows"], strict=True)
    ]
    return float(np.mean(change)), float(1.96 * np.std(change, ddof=1) / np.sqrt(len(change)))


def _results(model, cache_cfg, batches, scored, tokens, seq_len, rows_of=None) -> dict:
    """The result dict from per-chunk sums (replicated scalars: every host holds
    the totals), when compared the per-token KL of every window, and with
    `rows_of` (from _run) the per-window sums (`windows`)."""
    scored = jax.device_get(scored)
    compared = ("kl", "agree", "reference_nll") if tokens is not None else ()
    keys = ("nll", "correct", "weight", *compared)
    totals = {k: sum(float(sums[k]) for sums in scored) for k in keys}
    result = {
        **summarize(totals, target_bytes(batches)),
        **cache_bytes_per_token(model.config, cache_cfg, seq_len),
    }
    if rows_of is not None:
        result["windows"] = _window_sums(rows_of)
    if tokens is None:
        return result
    # Per-token KL of the tokens that count: [B, T] per window, the rows of every host.
    values = []
    for batch, window in zip(batches, tokens, strict=True):
        kl = np.concatenate([sharding.fetch(part) for part in window], axis=1)
        values.append(kl[np.asarray(batch["weights"]) > 0])
    values = np.concatenate(values)
    weight = max(totals["weight"], 1.0)
    reference_ppl = float(np.exp(totals["reference_nll"] / weight))
    result.update(
        kl_mean=totals["kl"] / weight,
        kl_p99=float(np.percentile(values, 99)) if values.size else 0.0,
        top1_agreement=totals["agree"] / weight,
        delta_ppl=result["ppl"] - reference_ppl,
    )
    return result


def _prepared(model_cfg, cache_cfg, batches, chunk, prefill):
    """(the model, the frozen cache section, (chunk, prefill)), each checked."""
    validate_cache_config(cache_cfg, model_cfg)
    steps = (check_count("eval.chunk", chunk), check_count("eval.prefill", prefill, minimum=0))
    if not batches:
        raise ValueError("no evaluation batches: the held-out split produced no windows")
    return Transformer(model_cfg), frozen(cache_cfg), steps


def evaluate_reference(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    params,
    batches: Sequence[Mapping],
    *,
    chunk: int,
    prefill: int = 0,
    mesh: Mesh | None = None,
    rules: tuple | None = None,
    windows: bool = False,
) -> Reference:
    """`cache_cfg` (normally `full_cache(...)` of the caches to compare) evaluated
    once as evaluate() does, scored against itself (result: kl 0, agreement 1,
    delta_ppl 0), its logits kept for `evaluate(..., reference=)` unless all
    windows' would pass KEEP_REFERENCE_BYTES. windows: its result holds the
    per-window sums (module docstring)."""
    _validated_reference(cache_cfg, model_cfg)
    model, cache_cfg, steps = _prepared(model_cfg, cache_cfg, batches, chunk, prefill)
    mesh, rules, placed_params = _placed(model, params, mesh, rules)
    logit_bytes = sum(np.size(b["inputs"]) for b in batches) * model.config.vocab_size * 4
    keep = logit_bytes <= KEEP_REFERENCE_BYTES
    scored, tokens, kept, seq_len, rows_of = _run(
        model, cache_cfg, placed_params, batches, steps, mesh, rules,
        compare=True, reference=None, keep=keep, per_row=windows,
    )  # fmt: skip
    return Reference(
        model_cfg=model.config,
        cache_cfg=cache_cfg,
        chunk=steps[0],
        prefill=steps[1],
        mesh=mesh,
        rules=rules,
        batches=_digest(batches),
        result=_results(model, cache_cfg, batches, scored, tokens, seq_len, rows_of),
        logits=kept,
    )


def evaluate(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    params,
    batches: Sequence[Mapping],
    *,
    chunk: int,
    prefill: int = 0,
    mesh: Mesh | None = None,
    rules: tuple | None = None,
    reference: Mapping | Reference | None = None,
    windows: bool = False,
) -> dict:
    """Loss, perplexity, bits per byte and accuracy of `params` over `batches`
    (dicts of inputs/targets/weights [B, T]) run through `cache_cfg`.

    With `reference` (a cache config, evaluated first, or a Reference from
    evaluate_reference over the same model, params, batches, chunk, prefill and mesh)
    the result adds kl_mean, kl_p99, top1_agreement and delta_ppl against it
    (module docstring). With `windows` it adds `windows`, the per-window sums
    of nll, correct and weight (module docstring).

    With `mesh` (kvlab/sharding.py) the evaluation runs there: params placed by
    their logical axes, each window's cache laid out (init_cache(mesh=)) and its
    rows split as far as the batch divides, by `rules` (default
    kvlab.sharding.axis_rules()). A mesh of one device runs the single-device
    program.

    A mesh spanning several hosts (kvlab.sharding.initialize_distributed) is fed
    as training is: every host holds `batches` (the same on each), gives its
    devices only the rows they hold (sharding.process_rows, rows_array), and
    after the cross-host reduction (and a gather of the per-token KL) every host
    returns the same result."""
    if reference is not None and not isinstance(reference, Reference):
        reference = evaluate_reference(
            model_cfg, reference, params, batches, chunk=chunk, prefill=prefill, mesh=mesh,
            rules=rules,
        )  # fmt: skip
    model, cache_cfg, steps = _prepared(model_cfg, cache_cfg, batches, chunk, prefill)
    mesh, rules, params = _placed(model, params, mesh, rules)
    if reference is not None:
        _check_reference(reference, model, batches, steps, mesh, rules)
    scored, tokens, _, seq_len, rows_of = _run(
        model, cache_cfg, params, batches, steps, mesh, rules,
        compare=reference is not None, reference=reference, keep=False, per_row=windows,
    )  # fmt: skip
    return _results(model, cache_cfg, batches, scored, tokens, seq_len, rows_of)


def check_finite(result: Mapping, what: str) -> Mapping:
    """`result` (evaluate's) when its loss and, compared with a reference, its KL
    are finite numbers; else ValueError naming `what` (the model and cache), so a
    NaN is never reported or written as a measurement."""
    bad = [key for key in ("loss", "kl_mean") if key in result and not np.isfinite(result[key])]
    if bad:
        shown = ", ".join(f"{key}={result[key]}" for key in bad)
        raise ValueError(
            f"{what}: the evaluation gave {shown} (ppl {result['ppl']}): the model's logits "
            "were not finite numbers, so there is no result to report; check the weights "
            "(non-finite values, or an overflow in model.dtype) and the cache's dtype"
        )
    return result


def full_precision(cache_cfg: Mapping) -> ml_collections.ConfigDict:
    """The same cache with every tensor stored at 16 bits (the baseline)."""
    baseline = ml_collections.ConfigDict(cache_cfg)
    for prefix in CACHED_PREFIXES:
        baseline[f"{prefix}_bits"] = 16
    return baseline


def full_cache(cache_cfg: Mapping) -> ml_collections.ConfigDict:
    """The reference every cache of a model is compared with: the same cache with
    every tensor at 16 bits and every token kept (a copy; `cache_cfg` is unchanged)."""
    baseline = full_precision(ml_collections.ConfigDict(cache_cfg.to_dict()))
    baseline.evict.method = "none"
    return baseline
