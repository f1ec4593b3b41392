"""kvpress's protocol on kvlab's caches: compress a context once, answer its questions.

    rows = run_benchmark(model_cfg, params, tokenizer, records, cache_cfg)

Each record (kvlab/data/ruler.py's schema: context, question, answer_prefix,
answer, max_new_tokens) is read as kvpress's pipeline reads it: the context is
prefilled in one step and compressed after it (cache.evict.when='after_prefill',
Transformer's compress=True), then the question and the answer prefix are fed
and the answer generated greedily from that one compressed cache; records with
the same context share it (its questions are answered from copies).
`query_aware=True` compresses context and question together (kvpress's
query-aware mode): the question is then part of what is scored. `block_size`
prefills each context that many tokens a step, each row compressed after every
step to the target of its whole context (kvpress's BlockPress, the block-wise
prefill of KeyDiff's paper; Transformer's compress=lengths): no row ever holds
more than its target and one block, and, unlike BlockPress, which scores blocks
of a context whose keys came from one full forward, each block attends only to
what the earlier blocks kept (a real chunked prefill). The cache
really holds only what it keeps: `bytes_per_token` is its allocated bytes per
row over its capacity (kvlab.cache_bytes), the number kvpress cannot give.

Rows are batched `batch_size` at a time, right-padded to one width (contexts to
a multiple of 64 tokens, questions of 16), so one compiled prefill and one
compiled answer loop serve a whole run of a cache.

`kvpress_evict(method)` is the cache.evict section that reproduces kvpress's
defaults for a method both have (docs/references.md lists what still differs).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from kvlab.cache import cache_bytes, init_cache
from kvlab.cache.evict.policy import scorer_of
from kvlab.cache.evict.scorers import base_scorers
from kvlab.config import validate_cache_config
from kvlab.data.ruler import score
from kvlab.model import Transformer

# kvpress's defaults per method (its presses' constructor arguments and scores): no
# recent window kept (KNorm, KeyDiff, LagKV, random), TOVA's last token kept (its score
# padded with the maximum), SnapKV's observation window of 64 queries and average
# pooling over 5 with the window itself kept, AdaKV's safeguard alpha 0.20, PyramidKV's
# beta 20, H2O as ObservedAttentionPress (attention averaged over the queries that saw
# a token), KVzipPress and FastKVzipPress ranking all layers' tokens together
# (layerwise=False: the calibration contexts' shares, scorers.global_shares). A wrapper
# ('chunkkv:knorm') takes its scorer's.
_WINDOW = dict(obs_window=64, kernel=5, recent=64, options={"pooling": "mean"})
DECODING_BUFFER = 256  # DecodingPress's hidden_states_buffer_size
KVPRESS_DEFAULTS = {
    "*": dict(recent=0),
    "tova": dict(recent=1),
    "h2o": dict(options={"average": True}),
    "snapkv": _WINDOW,
    "pyramidkv": dict(_WINDOW, pyramid_beta=20.0),
    "adakv": dict(_WINDOW, adakv_floor=0.2),
    "kvzip": dict(options={"layerwise": False}),
    "fast_kvzip": dict(options={"layerwise": False}),
}


def kvpress_evict(method: str) -> dict:
    """cache.evict fields that give `method` kvpress's defaults (a composed 'a+b':
    both scorers', their options together)."""
    fields: dict = dict(KVPRESS_DEFAULTS["*"])
    for scorer in base_scorers(method):
        preset = KVPRESS_DEFAULTS.get(scorer, {})
        options = {**fields.get("options", {}), **preset.get("options", {})}
        fields.update(preset)
        if options:
            fields["options"] = options
    return fields


def kvpress_decoding(method: str, target: int, interval: int) -> dict:
    """cache.evict fields of kvpress's DecodingPress over `method` at its defaults
    (`target`: target_size, `interval`: compression_interval): a scorer that reads
    every query buffers the last hidden_states_buffer_size (256) decode steps' of
    an interval (at most `interval`), evict.QueryBuffer; the prompt's room
    (cache.evict.headroom) is the caller's."""
    fields = dict(kvpress_evict(method), method=method, when="decoding")
    fields.update(budget=target, interval=interval)
    if scorer_of(method).observes == "all":
        fields["obs_window"] = min(DECODING_BUFFER, interval)
    return fields


def benchmark_cache(
    cache_cfg: Mapping, method: str, ratio: float, headroom: int, kvpress: bool = True
) -> ml_collections.ConfigDict:
    """`cache_cfg` compressing each context to `ratio` of it (kept share) after its
    prefill, with `headroom` tokens after it; method 'none' keeps everything."""
    cache = ml_collections.ConfigDict(cache_cfg).copy_and_resolve_references()
    if method == "none":
        cache.evict.update(method="none", ratio=1.0, budget=0)
        return cache
    cache.evict.update(method=method, ratio=ratio, budget=0, when="after_prefill")
    cache.evict.headroom = headroom
    if kvpress:
        cache.evict.update(kvpress_evict(method))
    return cache


def context_width(tokenizer, records: Sequence[Mapping], query_aware: bool = False) -> int:
    """The tokens run_benchmark gives each context: the longest (with its question
    where query-aware), rounded up to a multiple of 64."""
    return _width(max(map(len, _prompts(tokenizer, records, query_aware)[0])), 64)


def _prompts(tokenizer, records: Sequence[Mapping], query_aware: bool):
    """(contexts, questions) in tokens; query-aware, each question joins its context."""
    contexts = [tokenizer.encode(r["context"]) for r in records]
    questions = [tokenizer.encode(r["question"] + r["answer_prefix"]) for r in records]
    if query_aware:  # the question belongs to the compressed part
        contexts = [c + q for c, q in zip(contexts, questions, strict=True)]
        questions = [[] for _ in records]
    return contexts, questions


def _width(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


def _padded(rows: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens, np.asarray([len(r) for r in rows], np.int32)


def _prefill(model, params, cache, tokens, lengths, block: int, counts=None):
    """The contexts in one step (block 0), or `block` tokens a step with each row
    compressed after every step to its whole context's target (BlockPress); the
    cache is reused (copies). `counts`: each row's tokens, its context's `lengths`
    and the probes after it (KVzip's), default the contexts alone."""
    block = block or tokens.shape[1]
    counts = lengths if counts is None else counts
    for start in range(0, tokens.shape[1], block):
        fed = np.clip(counts - start, 0, block).astype(np.int32)
        cache = _prefill_step(model, params, cache, tokens[:, start : start + block], fed, lengths)
    return cache


@functools.partial(jax.jit, static_argnums=0)
def _prefill_step(model, params, cache, tokens, fed, lengths):
    _, cache = model.apply(
        {"params": params},
        tokens,
        cache=cache,
        num_tokens=fed,
        compress=lengths,  # each row's whole context: its target
        logits_at=jnp.zeros_like(fed),
    )
    return cache


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _answer(model, params, cache, tokens, lengths, steps, compress):
    """The questions fed after the cached contexts, then `steps` greedy tokens
    (int32[B, steps]); `compress`: the prompt is the context (query-aware)."""
    logits, cache = model.apply(
        {"params": params},
        tokens,
        cache=cache,
        num_tokens=lengths,
        compress=True if compress else None,  # None: no row ends its context here
        logits_at=lengths - 1,
    )
    token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    out = jnp.zeros((tokens.shape[0], steps), jnp.int32).at[:, 0].set(token)

    def step(i, carry):
        token, cache, out = carry
        logits, cache = model.apply({"params": params}, token[:, None], cache=cache)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return token, cache, out.at[:, i].set(token)

    _, cache, out = jax.lax.fori_loop(1, steps, step, (token, cache, out))
    return out, cache.errors


def run_benchmark(
    model_cfg: Mapping,
    params,
    tokenizer,
    records: Sequence[Mapping],
    cache_cfg: Mapping,
    *,
    query_aware: bool = False,
    batch_size: int = 8,
    block_size: int = 0,
) -> list[dict]:
    """One row per record: task, score (RULER's string_match_all), the prediction,
    the context's tokens, and the cache's bytes per token and label fields.
    `block_size` > 0 prefills each context `block_size` tokens a step, compressed
    after each (module docstring)."""
    if block_size < 0 or (block_size and query_aware):
        raise ValueError(
            f"block_size={block_size}: set 0 (one prefill step) or a positive number of "
            "tokens, without query_aware (the question is not prefilled in blocks)"
        )
    method = cache_cfg["evict"]["method"]
    scorer = scorer_of(method)
    probing = scorer is not None and scorer.observes == "probes"
    if probing and (query_aware or block_size):
        raise ValueError(
            f"cache.evict.method={method!r} scores each context by probes fed after it "
            "whole in one step: run it with query_aware=False and block_size=0"
        )
    model = Transformer(model_cfg)
    contexts, questions = _prompts(tokenizer, records, query_aware)
    width = _width(max(map(len, contexts)), 64)
    question_width = _width(max(map(len, questions)), 16) if not query_aware else 0
    steps = max(r["max_new_tokens"] for r in records)
    headroom = question_width + steps
    max_len = width + headroom
    cache_cfg = ml_collections.ConfigDict(cache_cfg).copy_and_resolve_references()
    # Room beside the budget: after_prefill's for the question and the answer, decoding's
    # for the context stored whole; a cache that evicts every step has none.
    room = {"after_prefill": headroom, "decoding": width}
    if cache_cfg.evict.method != "none" and cache_cfg.evict.when in room:
        cache_cfg.evict.headroom = room[cache_cfg.evict.when]
    validate_cache_config(cache_cfg, model_cfg)
    bytes_per_token = cache_bytes(model_cfg, cache_cfg, 1, max_len) / max_len
    # Records with one context share its compressed cache (query-aware: none share).
    shared: dict[tuple, list[int]] = {}
    for i, context in enumerate(contexts):
        shared.setdefault((i,) if query_aware else tuple(context), []).append(i)
    groups = list(shared.values())
    answers: dict[int, tuple[list[int], float]] = {}
    for start in range(0, len(groups), batch_size):
        chunk = groups[start : start + batch_size]
        began = time.perf_counter()
        tokens, lengths = _padded([contexts[g[0]] for g in chunk], width)
        counts = None
        if probing:  # each context, then its probes, in the step that compresses it
            rows = [contexts[g[0]] for g in chunk]
            rows = [[*c, *scorer.probe_tokens(tokenizer.encode, c)] for c in rows]
            tokens, counts = _padded(rows, _width(max(map(len, rows)), 64))
        cache = init_cache(model_cfg, cache_cfg, len(chunk), max_len)
        if query_aware:
            out, errors = _answer(model, params, cache, tokens, lengths, steps, True)
            found = [(g[0], out[row], errors[row]) for row, g in enumerate(chunk)]
        else:
            cache = _prefill(model, params, cache, tokens, lengths, block_size, counts)
            found = []
            for turn in range(max(map(len, chunk))):  # the turn-th question of each context
                asked = [g[turn] if turn < len(g) else g[0] for g in chunk]
                q_tokens, q_lengths = _padded([questions[i] for i in asked], question_width)
                out, errors = _answer(model, params, cache, q_tokens, q_lengths, steps, False)
                found += [
                    (g[turn], out[row], errors[row]) for row, g in enumerate(chunk) if turn < len(g)
                ]
        found = jax.device_get(found)
        seconds = (time.perf_counter() - began) / len(found)
        flagged = [i for i, _, error in found if error]
        if flagged:
            raise ValueError(f"the benchmark's cache flagged records {flagged}")
        answers.update({i: (out.tolist(), seconds) for i, out, _ in found})
    end = getattr(tokenizer, "end_token", None)
    rows = []
    for i, record in enumerate(records):
        ids, seconds = answers[i]
        ids = ids[: record["max_new_tokens"]]
        if end is not None and end in ids:
            ids = ids[: ids.index(end)]
        prediction = tokenizer.decode(ids)
        rows.append(
            dict(
                task=record["task"],
                score=score(prediction, record["answer"]),
                prediction=prediction,
                context_tokens=len(contexts[i]),
                bytes_per_token=bytes_per_token,
                seconds=seconds,
            )
        )
    return rows
