"""The engine: continuous batching over a shared page pool gives every request
what it gets alone, with prefix caching on or off, under preemption, and with
its decode steps run in compiled loops that end mid-way for some requests."""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.cache.evict import scorer_of
from kvlab.eval.calibrate import init_gates, save_gates
from tests.helpers import build, count_compiles, mla_config, tiny_config

NEW = 6
KIVI = dict(k_bits=4, k_axis="channel", v_bits=4, v_axis="token", group_size=4)


def engine_config(prefix_caching: bool, num_pages: int, **model):
    cfg = tiny_config(**model)
    cfg.cache.update(kind="paged", page_size=8, num_pages=num_pages, prefix_caching=prefix_caching)
    return kvlab.validate_config(cfg)


def requests(seed: int = 0, count: int = 7):
    """Prompts sharing a 20-token system prompt, with their own tails."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 20).tolist()
    return [system + rng.integers(0, 256, int(rng.integers(1, 14))).tolist() for _ in range(count)]


SOLO_WIDTH, SOLO_MAX_LEN = 40, 48


def solo(cfg, prompt):
    """The prompt's tokens generated alone: one row, right-padded to SOLO_WIDTH with
    its length given, so that every prompt of a config runs one compiled loop."""
    model, params, _ = build(cfg)
    cache = kvlab.validate_config(cfg.copy_and_resolve_references()).cache
    cache.kind = "dense"
    padded = np.zeros((1, SOLO_WIDTH), np.int32)
    padded[0, : len(prompt)] = prompt
    out = kvlab.generate(
        model,
        params,
        padded,
        prompt_lengths=np.array([len(prompt)], np.int32),
        cache_cfg=cache,
        max_new_tokens=NEW,
        max_len=SOLO_MAX_LEN,
    )
    return np.asarray(out)[0, len(prompt) : len(prompt) + NEW].tolist()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_twice_the_demand_of_the_pages_finishes_every_request_as_alone(prefix_caching):
    # 3 slots of up to 48 tokens want 3 x 5 pages at most; the pool has 7.
    cfg = engine_config(prefix_caching, num_pages=7, num_kv_heads=2)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    prompts = requests()
    outputs = engine.generate(prompts, max_new_tokens=NEW)
    assert outputs == [solo(cfg, p) for p in prompts]
    assert engine.stats.preemptions > 0
    assert engine.stats.generated_tokens == NEW * len(prompts)
    assert engine.stats.calls < engine.stats.steps  # decode steps ran in loops
    assert engine.pages.num_free == 7  # every page came back (cached ones are evictable)
    computed = engine.stats.prefill_tokens
    if prefix_caching:
        assert computed < engine.stats.prompt_tokens
        assert engine.pages.stats.hit_tokens > 0
    else:  # every prompt once, and again for each preempted request
        assert computed >= engine.stats.prompt_tokens


def test_layers_sharing_a_cache_layer_give_every_request_what_it_gets_alone():
    """Cross-layer attention (model.topology='cla:2', three layers: two cache
    layers) through the shared pool, with prefix caching and preemption."""
    cfg = engine_config(True, num_pages=7, num_kv_heads=2, num_layers=3, topology="cla:2")
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    prompts = requests(seed=1)
    assert engine.generate(prompts, max_new_tokens=NEW) == [solo(cfg, p) for p in prompts]
    assert engine.pages.stats.hit_tokens > 0


@pytest.mark.parametrize("storage", [{}, dict(k_bits=4, v_bits=4, k_axis="token")])
def test_a_hybrid_model_gives_every_request_what_it_gets_alone(storage):
    """Sliding layers (window 5) between full ones (model.layer_types): the pool
    holds the full layers' pages (16-bit or 4-bit codes), each slot a ring per
    sliding layer; under preemption every request gets its solo output."""
    types = ("sliding", "full", "sliding")
    cfg = engine_config(False, num_pages=7, num_kv_heads=2, num_layers=3, sliding_window=5)
    cfg.model.layer_types = types
    cfg.cache.update(storage)
    _, params, _ = build(kvlab.validate_config(cfg))
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    assert not engine.evicting and engine.scheduler.pages_per_slot == 6
    prompts = requests(seed=3)
    assert engine.generate(prompts, max_new_tokens=NEW) == [solo(cfg, p) for p in prompts]
    assert engine.stats.preemptions > 0 and engine.pages.num_free == 7
    with pytest.raises(
        ValueError, match=r"cache.prefix_caching=True cannot serve model.layer_types"
    ):
        kvlab.Engine(cfg.model, dict(cfg.cache, prefix_caching=True), params, max_slots=3)


def test_first_positions_kept_give_every_request_what_it_gets_alone():
    """4-bit codes with each row's first 2 positions in cache.dtype beside them
    (cache.<prefix>_full_first, kept per slot as the ring is): slots reused by later
    requests and preempted ones recomputed, every request gets its solo output; a
    shared prefix's pages would hold no first tokens, so prefix caching is refused."""
    cfg = engine_config(False, num_pages=7, num_kv_heads=2)
    cfg.cache.update(KIVI, k_full_first=2, v_full_first=2)
    _, params, _ = build(kvlab.validate_config(cfg))
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    prompts = requests(seed=1, count=4)
    assert engine.generate(prompts, max_new_tokens=NEW) == [solo(cfg, p) for p in prompts]
    assert engine.stats.preemptions > 0 and engine.pages.num_free == 7
    with pytest.raises(ValueError, match=r"cache.k_full_first=2 cannot combine with cache.prefix"):
        kvlab.Engine(cfg.model, dict(cfg.cache, prefix_caching=True), params, max_slots=3)


@pytest.mark.parametrize(
    "method, storage",
    [
        ("snapkv", {}),
        ("tova", dict(KIVI, k_axis="token", k_transform="hadamard")),
        ("think:snapkv", {}),
        ("adakv", {}),
        ("fast_kvzip", {}),
    ],
    ids=["snapkv", "tova_rotated_4_bit", "think_snapkv", "adakv", "fast_kvzip"],
)
def test_evicting_at_half_the_context_gives_every_request_what_it_gets_alone(
    method, storage, tmp_path
):
    """Evicting in a shared pool: each slot keeps 12 of up to 24 tokens (3 pages
    of 4, not 6), the pool of 7 pages preempts, and every request gets the output
    it gets alone in the engine with the same policy (its generated tokens are
    replayed one by one after a preemption). Also TOVA over keys rotated before
    4-bit storage (the methods added through registries, docs/adding-a-method.md),
    and keys pruned of half their channels (ThinK: chosen per slot's request).
    A pool of both heads' slots (AdaKV; Fast KVzip's gates scoring each token
    from its hidden state as it comes) fills 2 rows a token: 2 x 12 rows, 6
    pages a slot, in a pool of twice the pages."""
    share = 2 if scorer_of(method).pooled else 1
    cfg = engine_config(False, num_pages=7 * share, num_kv_heads=2)
    cfg.cache.update(page_size=4, **storage)
    cfg.cache.evict.update(method=method, ratio=0.5, recent=2, obs_window=4)
    if method == "fast_kvzip":
        m = cfg.model
        gates = init_gates(m.num_layers, m.embed_dim, 2, m.num_heads // 2, d=4, sinks=2, seed=3)
        save_gates(tmp_path / "gates.npz", gates)
        cfg.cache.evict.options = {"gates": str(tmp_path / "gates.npz")}
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=24, prefill_chunk=8)
    assert engine.scheduler.pages_per_slot == 3 * share
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 18, 7)]
    outputs = engine.generate(prompts, max_new_tokens=NEW)
    alone = kvlab.Engine(
        cfg.model, cfg.cache, params, max_slots=1, max_len=24, prefill_chunk=8, decode_steps=1
    )
    assert outputs == [alone.generate([p], max_new_tokens=NEW)[0] for p in prompts]
    assert engine.stats.calls < engine.stats.steps  # decode loops, alone one step per call
    assert engine.stats.preemptions > 0
    assert engine.pages.num_free == 7 * share
    assert max(len(p) for p in prompts) + NEW > 12  # some requests evicted


@pytest.mark.parametrize("method, storage", [("snapkv", {}), ("sinks", KIVI)])
def test_eviction_with_prefix_caching_never_writes_a_cached_page(method, storage):
    """Requests sharing a 20-token system prompt keep 24 tokens each: those whose
    prompt fits register their pages, later ones match them, and a request about
    to overwrite slots first copies its cached pages. Outputs equal prefix caching
    off, and a second round, served from the cached pages, gives them again.
    Over KIVI's storage the pages hold whole groups of 4 settled tokens."""
    outputs, computed = {}, {}
    for on in (False, True):
        cfg = engine_config(on, num_pages=40, num_kv_heads=2)
        cfg.cache.update(page_size=4, **storage)
        cfg.cache.evict.update(method=method, budget=24, recent=2, obs_window=4)
        _, params, _ = build(cfg)
        engine = kvlab.Engine(
            cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8
        )
        outputs[on] = engine.generate(requests(seed=1, count=6), max_new_tokens=10)
        assert engine.generate(requests(seed=1, count=6), max_new_tokens=10) == outputs[on]
        computed[on] = engine.stats.prefill_tokens
    assert outputs[True] == outputs[False]
    assert computed[True] < computed[False]


def quantized_gqa():
    cfg = tiny_config(num_kv_heads=2)
    cfg.cache.update(k_bits=4, v_bits=8, k_axis="channel", group_size=8)
    return cfg


@pytest.mark.parametrize("make", [mla_config, quantized_gqa], ids=["mla", "gqa_k4v8"])
def test_prefix_caching_on_equals_off(make):
    outputs, computed = {}, {}
    for on in (False, True):
        cfg = make()
        cfg.cache.update(kind="paged", page_size=8, num_pages=16, prefix_caching=on)
        kvlab.validate_config(cfg)
        _, params, _ = build(cfg)
        engine = kvlab.Engine(
            cfg.model, cfg.cache, params, max_slots=2, max_len=48, prefill_chunk=16
        )
        outputs[on] = engine.generate(requests(seed=1, count=4), max_new_tokens=NEW)
        computed[on] = engine.stats.prefill_tokens
    assert outputs[True] == outputs[False]
    assert computed[True] < computed[False]


def staggered(seed: int, count: int):
    """Prompts of 3, 11 and 19 tokens (1, 2 and 3 chunks of 8), repeated: requests
    admitted together start decoding at different steps."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 3 + 8 * (i % 3)).tolist() for i in range(count)]


def test_requests_that_run_out_mid_loop_get_what_they_get_alone():
    """Three requests with 4, 5 and 6 tokens left when the last prompt chunk is
    fed: it and 5 decode steps run in one call, in which two slots stop early
    (their budgets), and every output is what the request gets alone."""
    cfg = engine_config(False, num_pages=7, num_kv_heads=2)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    loops, run = [], engine._run

    def recorded(step):  # the engine's own step, with what it planned noted
        next_tokens = run(step)
        loops.append((step.steps, step.budgets.tolist(), len(next_tokens)))
        return next_tokens

    engine._run = recorded
    prompts = staggered(seed=7, count=3)
    assert engine.generate(prompts, max_new_tokens=NEW) == [solo(cfg, p) for p in prompts]
    assert loops[-1] == (6, [4, 5, 6], 6)  # after 2 prefill steps
    assert (engine.stats.calls, engine.stats.steps) == (3, 8)


def test_end_token_ends_requests_mid_loop_as_alone():
    """With end_token, each request stops where it stops alone, while others wait
    (the loop ends at it) and once every request runs (the others go on)."""
    cfg = engine_config(False, num_pages=7, num_kv_heads=2)
    _, params, _ = build(cfg)
    prompts = staggered(seed=8, count=5)
    plain = [solo(cfg, p) for p in prompts]
    # A token that some request emits after its first, and none emits first.
    end = next(t for out in plain for t in out[1:] if all(o[0] != t for o in plain))
    expected = [out[: out.index(end) + 1] if end in out else out for out in plain]
    engine = kvlab.Engine(
        cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8, end_token=end
    )
    assert engine.generate(prompts, max_new_tokens=NEW) == expected
    assert any(len(out) < NEW for out in expected)
    assert engine.stats.calls < engine.stats.steps and engine.pages.num_free == 7


def test_a_run_is_greedy_steps_until_its_rules_stop_it():
    """greedy_run alone, from one cache: a prompt chunk and then decode steps in
    one call give the tokens of one call per step; a slot stops feeding after
    its budget or end_token, and with stop_on_finish the loop ends after the
    first step in which one stops."""
    cfg = engine_config(False, num_pages=7, num_kv_heads=2)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    tables = np.full((3, 6), -1, np.int32)
    tables[:, :2] = np.arange(6).reshape(3, 2)  # 16 tokens per slot
    prompts = np.random.default_rng(9).integers(0, 256, (3, 8)).astype(np.int32)
    empty = engine._cache.replace(block_tables=jnp.asarray(tables), lengths=jnp.zeros(3, jnp.int32))
    copy = functools.partial(jax.tree.map, jnp.copy)  # every call donates its cache

    def run(cache, tokens, budgets, steps=6, stop_on_finish=False, end_token=-1):
        chunk, counts = tokens.shape[1] > 1, np.full(3, tokens.shape[1], np.int32)
        padded = np.zeros((3, 8), np.int32)  # the engine's one program: width prefill_chunk
        padded[:, : tokens.shape[1]] = tokens
        out, ran, cache = kvlab.serve.engine.greedy_run(
            engine.model, 32, params, copy(cache), padded, counts, np.bool_(chunk),
            np.array(budgets, np.int32), np.int32(steps), np.bool_(stop_on_finish),
            np.int32(end_token),
        )  # fmt: skip
        cache.check()
        return np.asarray(out)[: int(ran)], cache

    tokens, cache, expected = prompts, empty, []
    for _ in range(6):  # one step per call
        out, cache = run(cache, tokens, [1, 1, 1], steps=1)
        tokens = out.T  # [3, 1]
        expected.append(out[0])
    expected = np.array(expected)  # [6 steps, 3 slots]

    out, cache = run(empty, prompts, [6, 6, 6])
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(cache.lengths, [13, 13, 13])
    out, cache = run(empty, prompts, [6, 2, 6])  # slot 1 stops after 2 tokens, the others go on
    np.testing.assert_array_equal(out[:, [0, 2]], expected[:, [0, 2]])
    np.testing.assert_array_equal(out[:2, 1], expected[:2, 1])
    np.testing.assert_array_equal(cache.lengths, [13, 9, 13])
    out, _ = run(empty, prompts, [6, 2, 6], stop_on_finish=True)
    np.testing.assert_array_equal(out, expected[:2])
    end = expected[3, 2]  # slot 2 emits it in step 4, maybe another slot sooner
    stop = 1 + min(np.flatnonzero((expected == end).any(axis=1)))
    out, _ = run(empty, prompts, [6, 6, 6], stop_on_finish=True, end_token=end)
    np.testing.assert_array_equal(out, expected[:stop])
    out, cache = run(empty, prompts, [6, 6, 6], end_token=end)  # each stops at its own end
    for slot in range(3):
        ended = np.flatnonzero(expected[:, slot] == end)
        emitted = 1 + ended[0] if len(ended) else 6
        assert cache.lengths[slot] == 8 + emitted - 1  # the last emitted token is not fed
        np.testing.assert_array_equal(out[:emitted, slot], expected[:emitted, slot])


def test_bad_engine_inputs_are_refused():
    cfg = engine_config(False, num_pages=4)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=2, max_len=32)
    with pytest.raises(ValueError, match="requests is empty"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"requests\[1\] needs 35 cached tokens"):
        engine.generate([[1, 2], list(range(30))], max_new_tokens=6)
    with pytest.raises(ValueError, match=r"requests\[0\] is empty"):
        engine.generate([[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="cache.num_pages=2 is too few for one sequence"):
        kvlab.Engine(cfg.model, {**cfg.cache, "num_pages": 2}, params, max_slots=2, max_len=32)
    dense = dict(cfg.cache, kind="dense")
    with pytest.raises(ValueError, match="cache.kind='dense'"):
        kvlab.Engine(cfg.model, dense, params)
    with pytest.raises(ValueError, match="cache.residual=16 with cache.prefix_caching"):
        quantized = dict(cfg.cache, prefix_caching=True, k_bits=4, residual=16, page_size=16)
        kvlab.Engine(cfg.model, quantized, params)


def test_the_pool_holds_exactly_the_configured_pages():
    cfg = engine_config(False, num_pages=5)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=4, max_len=32)
    assert engine.pages.num_pages == 5
    for pool in engine._cache.layers[0].pools:
        assert pool.shape[1] == 5
    assert kvlab.tree_bytes(engine._cache) == kvlab.cache_bytes(
        cfg.model, dict(cfg.cache), batch_size=4, seq_len=32
    )


@pytest.fixture(scope="module")
def small_engine():
    """An engine over a 4-page pool (32 tokens) that the refusal tests never run."""
    cfg = engine_config(False, num_pages=4)
    _, params, _ = build(cfg)
    return kvlab.Engine(cfg.model, cfg.cache, params, max_slots=2, max_len=32)


def test_numpy_requests_give_what_lists_give():
    cfg = engine_config(False, num_pages=7, num_kv_heads=2)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    prompts = [p[:21] for p in requests(seed=2, count=3)]
    expected = engine.generate(prompts, max_new_tokens=NEW)
    as_numpy = [
        np.array(prompts, np.int64),  # one 2-D array
        [np.array(p, np.int32) for p in prompts],  # a list of 1-D arrays
        [[np.uint8(t) for t in p] for p in prompts],  # numpy integer ids
    ]
    for given in as_numpy:
        outputs = engine.generate(given, max_new_tokens=np.int64(NEW))
        assert outputs == expected
        assert all(type(t) is int for out in outputs for t in out)
    assert expected[0] == solo(cfg, prompts[0])


@pytest.mark.parametrize(
    "given, message",
    [
        ([[1, 3.0]], r"requests\[0\]\[1\]=3.0 is not an integer token id"),
        ([[1, 2], [3.7]], r"requests\[1\]\[0\]=3.7 is not an integer token id"),
        ([["3"]], r"requests\[0\]\[0\]='3' is not an integer token id"),
        ([[True, 1]], r"requests\[0\]\[0\]=True is not an integer token id"),
        ([[[1, 2]]], r"requests\[0\]\[0\]=\[1, 2\] is not an integer token id"),
        (np.array([[1.0, 2.0]]), r"requests\[0\] has dtype float64: pass an integer array"),
        (np.array([[True]]), r"requests\[0\] has dtype bool"),
        (np.array([1, 2]), r"requests has shape \(2,\): pass a 2-D array"),
        ([1, 2], r"requests\[0\]=1 is not a list of token ids"),
        ([[1, 256]], r"requests\[0\]\[1\]=256 is outside the vocabulary: pass ids in 0..255"),
        ([[-1]], r"requests\[0\]\[0\]=-1 is outside the vocabulary"),
        ([[]], r"requests\[0\] is empty"),
        ([], "requests is empty"),
        ([[1, 2], list(range(30))], r"requests\[1\] needs 35 cached tokens .* max_len=32"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(small_engine, given, message):
    with pytest.raises(ValueError, match=message):
        small_engine.generate(given, max_new_tokens=6)
    assert small_engine.scheduler.idle and small_engine.pages.num_free == 4


@pytest.mark.parametrize("value", [0, -1, "4", 4.0, True])
def test_bad_counts_are_refused(small_engine, value):
    with pytest.raises(ValueError, match=f"max_new_tokens={value!r}"):
        small_engine.generate([[1, 2]], max_new_tokens=value)
    cfg = engine_config(False, num_pages=4)
    for name in ("max_slots", "max_len", "prefill_chunk", "decode_steps"):
        with pytest.raises(ValueError, match=f"{name}={value!r}.*pass an integer >= 1"):
            kvlab.Engine(cfg.model, cfg.cache, small_engine.params, **{name: value})


@pytest.mark.parametrize(
    "value, message",
    [
        (3.0, "is not an integer token id"),
        (True, "is not an integer"),
        (256, "is outside the vocabulary: pass ids in 0..255"),
    ],
)
def test_bad_end_token_is_refused(small_engine, value, message):
    cfg = engine_config(False, num_pages=4)
    with pytest.raises(ValueError, match=f"end_token={value!r} {message}"):
        kvlab.Engine(cfg.model, cfg.cache, small_engine.params, end_token=value)


def test_max_len_defaults_to_what_the_pool_holds():
    cfg = engine_config(False, num_pages=4)  # 4 pages of 8 tokens
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=2)
    assert engine.max_len == 32 and engine.num_pages == 4
    prompt = requests(seed=3, count=1)[0][:27]  # 27 + 6 - 1 = 32 tokens: the whole pool
    assert engine.generate([prompt], max_new_tokens=NEW) == [solo(cfg, prompt)]
    rows = kvlab.Engine(cfg.model, dict(cfg.cache, num_pages=0), params, max_slots=2)
    assert rows.max_len == kvlab.serve.engine.DEFAULT_MAX_LEN
    assert rows.num_pages == 2 * kvlab.serve.engine.DEFAULT_MAX_LEN // 8


def test_warm_up_compiles_every_step_and_changes_nothing():
    cfg = engine_config(True, num_pages=12)
    _, params, _ = build(cfg)
    make = lambda: kvlab.Engine(  # noqa: E731  (shapes no other test compiles)
        cfg.model, cfg.cache, params, max_slots=2, max_len=40, prefill_chunk=4
    )
    engine = make()
    with count_compiles() as compiled:
        engine.warm_up()
    assert compiled[0] >= 1  # the shapes were new: one program for [2, 4] and [2, 1] steps
    assert engine.pages.num_free == 12 and engine.pages.num_cached == 0
    prompts = requests(seed=4, count=3)
    with count_compiles() as compiled:
        outputs = engine.generate(prompts, max_new_tokens=NEW)
    assert compiled[0] == 0
    assert outputs == make().generate(prompts, max_new_tokens=NEW)


def test_every_step_checks_the_cache_for_flagged_rows(small_engine):
    from kvlab.cache import CacheError
    from kvlab.serve.scheduler import Step

    engine = kvlab.Engine(
        small_engine.model.config, small_engine.cache_cfg, small_engine.params, max_slots=2
    )
    step = Step.idle(2, 1, engine.scheduler.pages_per_slot)
    step.tokens[1, 0], step.counts[1], step.block_tables[1, 0] = 256, 1, 0  # outside the vocab
    with pytest.raises(CacheError, match="row 1 was given a token id outside the vocabulary"):
        engine._run(step)


def test_a_failed_step_leaves_an_empty_working_engine():
    cfg = engine_config(True, num_pages=7, num_kv_heads=2)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    prompts = requests(seed=5, count=2)
    expected = engine.generate(prompts, max_new_tokens=NEW)
    assert engine.pages.num_cached > 0
    engine.params = {"wrong": params}  # the model finds none of its weights
    with pytest.raises(flax.errors.ScopeParamNotFoundError):
        engine.generate(prompts, max_new_tokens=NEW)
    assert engine.scheduler.idle and engine.pages.num_free == 7 and engine.pages.num_cached == 0
    engine.params = params
    assert engine.generate(prompts, max_new_tokens=NEW) == expected
