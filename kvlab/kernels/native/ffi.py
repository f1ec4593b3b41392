"""kvlab's C++ CPU kernels (kernels.cc): built on first use, called through XLA's FFI.

load() -> str | None                the reason they cannot run here, or None (built, registered)
panel_matmul(x [M, K], panels [N / 32, K, 32]) -> [M, N]        M rows of x @ W
scores(q [..., M, H], k [..., S, H], limit) -> [..., M, S]      attention scores
weighted_sum(w [..., M, S], v [..., S, H], limit) -> [..., M, H] attention output
pool_scores(q, pool, pages, length, limit), pool_weighted_sum(w, pool, pages, limit)
                                    the same over page pools through block tables
owned_scores(q, keys, tags), owned_weighted_sum(w, values, listings)
                                    the same over a pool whose slots each belong to
                                    one KV head (AdaKV's), read by its queries alone
quant_scores(q, codes: Codes, limit), quant_weighted_sum(w, codes: Codes, limit)
                                    the same over quantized codes, read in place
write_tokens(buffer, new, slots) -> buffer     a 16-bit cache write, in place
top_k_last(x [..., C], k) -> int32 [..., k]    the k largest, among equals the later first

Each function here is the kernel's call alone (`jax.ffi.ffi_call` of a
target registered for the CPU): which operands it takes, and on which
platform a program calls it, is the backend's choice (kvlab/kernels/native,
jax.lax.platform_dependent), never checked here at trace time.

XLA:CPU runs a one-row product on one core and hands products of 2 to 16 rows
to a general matrix routine that repacks the weights on every call, so a decode
step (a few rows against every weight of the model) reads its weights at a
fraction of the memory bandwidth. `panel_matmul` reads weights stored as
32-column panels once per call on all of XLA's intra-op threads, whatever the
number of rows (a prompt's too: kernels.cc says how); `scores` and
`weighted_sum` do the same for decode attention's products over a cache, and
`quant_scores` and `quant_weighted_sum` over a quantized cache's packed codes
(kvlab/cache/quant/), dequantizing a few tokens at a time in the core's own
caches. Each attention kernel takes float32 queries or weights and up to
MAX_ROWS rows (caches in float32, or bfloat16 and float16 widened as they are
read). XLA:CPU also updates a 16-bit buffer through a float32 copy of all of
it, so `write_tokens` writes a 16-bit cache's new tokens in place.

The source is built with the system C++ compiler (`$CXX`, else `c++`) for
the best instruction set of ISAS the CPU has (AVX-512F; else AVX2 with FMA and
F16C, through avx2.h) the first time a process loads it, into
`$KVLAB_NATIVE_CACHE` (default ~/.cache/kvlab/native), named by a hash of the
sources, the flags and the jax and jaxlib versions, and written there
atomically. Without a compiler, on another CPU, or with KVLAB_NATIVE=0, load()
says why and nothing is registered.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 32  # columns per panel
MAX_ROWS = 16  # attention's query rows per KV head; more (a prompt) go to XLA's product
SOURCE = Path(__file__).with_name("kernels.cc")
# FFI target name -> the library's handler symbol
TARGETS = {
    "kvlab_panel_matmul": "KvlabPanelMatmul",
    "kvlab_scores": "KvlabScores",
    "kvlab_weighted_sum": "KvlabWeightedSum",
    "kvlab_owned_scores": "KvlabOwnedScores",
    "kvlab_owned_weighted_sum": "KvlabOwnedWeightedSum",
    "kvlab_quant_scores": "KvlabQuantScores",
    "kvlab_quant_weighted_sum": "KvlabQuantWeightedSum",
    "kvlab_write_tokens": "KvlabWriteTokens",
    "kvlab_top_k_last": "KvlabTopKLast",
}
HEADER = SOURCE.with_name("avx2.h")  # the AVX-512F intrinsics it uses, on AVX2
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
# Instruction sets, best first: the CPU flags (/proc/cpuinfo) each needs, and its own flags.
ISAS = (
    ("AVX-512F", {"avx512f", "fma"}, ("-mavx512f", "-mfma")),
    ("AVX2", {"avx2", "fma", "f16c"}, ("-mavx2", "-mfma", "-mf16c")),
)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "kvlab" / "native"
    return Path(os.environ.get("KVLAB_NATIVE_CACHE") or default)


def isa() -> tuple[str, tuple[str, ...]]:
    """The instruction set the kernels are built for here (its name and compiler
    flags): the best of ISAS this CPU has, or the one $KVLAB_NATIVE_ISA names (to
    test the AVX2 build on a CPU that has AVX-512F too). Raises LookupError
    saying why there is none."""
    wanted = os.environ.get("KVLAB_NATIVE_ISA") or None
    named = [isa for isa in ISAS if wanted in (None, isa[0])]
    if not named:
        known = ", ".join(name for name, _, _ in ISAS)
        raise LookupError(f"KVLAB_NATIVE_ISA={wanted!r} is none of {known}")
    have = _cpu_flags()
    for name, needs, flags in named:
        if needs <= have:
            return name, flags
    if wanted is not None:
        missing = ", ".join(sorted(named[0][1] - have))
        raise LookupError(f"KVLAB_NATIVE_ISA={wanted}: this CPU has no {missing}")
    raise LookupError("this CPU has neither AVX-512F nor AVX2 with FMA and F16C")


def build(directory: Path | None = None, flags: tuple[str, ...] | None = None) -> Path:
    """The compiled library's path in `directory` (default the cache), compiling it
    there first if it is missing, for an instruction set's `flags` (ISAS; default
    `isa()`'s). Raises RuntimeError with the compiler's output when the build
    fails, FileNotFoundError when there is no compiler."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C++ compiler {compiler!r} on PATH (set CXX to one)")
    include = jax.ffi.include_dir()
    source = SOURCE.read_bytes() + HEADER.read_bytes()
    versions = (jax.__version__, importlib.metadata.version("jaxlib"))  # the FFI headers' ABI
    flags = (*FLAGS, *(isa()[1] if flags is None else flags))
    key = hashlib.sha256(
        source + " ".join((compiler, *flags, *versions, include)).encode()
    ).hexdigest()[:16]
    directory = Path(directory) if directory is not None else _cache_dir()
    library = directory / f"kernels-{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(".kernels-*.so"):  # a build killed an hour ago or more
        if time.time() - stale.stat().st_mtime > 3600:
            stale.unlink(missing_ok=True)
    handle, partial = tempfile.mkstemp(dir=directory, prefix=".kernels-", suffix=".so")
    os.close(handle)
    try:
        command = [compiler, *flags, f"-I{include}", str(SOURCE), "-o", partial]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"building {SOURCE.name} failed ({' '.join(command)}):\n{done.stderr[-2000:]}"
            )
        os.replace(partial, library)  # a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


@functools.cache
def load() -> str | None:
    """Builds and registers the kernels once per process; the reason they are
    unavailable, or None."""
    if os.environ.get("KVLAB_NATIVE", "1") == "0":
        return "KVLAB_NATIVE=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are written for x86-64, not {platform.machine()}"
    try:
        _built()
    except LookupError as error:
        return str(error)
    try:
        path = build()
        try:
            library = ctypes.cdll.LoadLibrary(str(path))
        except OSError:  # a damaged file in the cache: build it again, once
            path.unlink(missing_ok=True)
            library = ctypes.cdll.LoadLibrary(str(build()))
    except (OSError, RuntimeError) as error:
        return str(error)
    for target, symbol in TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    return None


@functools.cache
def _built() -> str:
    """The name of the instruction set the kernels are built for in this process."""
    return isa()[0]


def available() -> bool:
    return load() is None


def _call(target: str, shape: tuple, *arrays: jax.Array) -> jax.Array:
    result = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.ffi.ffi_call(target, result, vmap_method="sequential")(*arrays)


def panel_matmul(x: jax.Array, panels: jax.Array) -> jax.Array:
    """x [M, K] @ W for float32 x and W stored as panels [N / 32, K, 32]
    (W[k, 32 b + j] = panels[b, k, j])."""
    (rows, depth), (count, panel_depth, width) = x.shape, panels.shape
    if panel_depth != depth or width != PANEL:
        raise ValueError(f"x {x.shape} and panels {panels.shape} do not multiply")
    return _call("kvlab_panel_matmul", (rows, count * PANEL), x, panels)


def panel_einsum(x: jax.Array, panels: jax.Array) -> jax.Array:
    """panel_matmul's product by XLA (any platform, any dtype)."""
    rows, count = x.shape[0], panels.shape[0]
    return jnp.einsum("mk,bkj->mbj", x, panels).reshape(rows, count * PANEL)


# Attention's products over a float32 cache take the kernels from 2 query rows and
# ATTENTION_MIN_BYTES of keys (`scores`) or values (`weighted_sum`) up, per build: a
# single query row is XLA's fused product, at memory speed; below the threshold
# XLA's multithreaded product is as fast or faster. AVX-512F (2-core Xeons): both
# from 1 MiB (work for both threads at 512 KiB each). AVX2 (a 2-core EPYC, best of
# interleaved calls, 2 KV heads of 16 or 64 numbers, 2 to 8 rows): the scores
# 1.1-2.5x XLA's from 512 KiB; the weighted sums 0.6-0.9x below 1 MiB and 0.8-1.25x
# at 1-2 MiB, so from 2 MiB. A 16-bit cache takes them at any size: XLA:CPU computes
# 16-bit products through float32 copies, several times slower.
PRODUCTS = ("scores", "weighted_sum")
ATTENTION_MIN_BYTES = {
    "AVX-512F": {"scores": 1 << 20, "weighted_sum": 1 << 20},
    "AVX2": {"scores": 512 << 10, "weighted_sum": 2 << 20},
}
HALF = (jnp.bfloat16, jnp.float16)  # 16-bit storage the kernels widen as they read


def _check_rows(rows: int) -> None:
    if rows > MAX_ROWS:
        raise ValueError(
            f"the attention kernels take at most MAX_ROWS={MAX_ROWS} query rows per slice, "
            f"not {rows}: leave more rows (a prompt) to XLA's product"
        )


def takes_attention(b: jax.Array, rows: int, products: tuple[str, ...] = PRODUCTS) -> bool:
    """Whether the kernels' `products` (`scores` of keys, `weighted_sum` of values,
    both of a latent) take `b` read by `rows` float32 queries per slice where they
    beat XLA's: 16-bit `b` at any size, float32 from 2 rows and each product's
    ATTENTION_MIN_BYTES for the build loaded here."""
    if rows > MAX_ROWS:
        return False
    if b.dtype in HALF:
        return True
    least = ATTENTION_MIN_BYTES[_built()]
    return b.dtype == jnp.float32 and rows >= 2 and b.size * 4 >= max(least[p] for p in products)


def _per_slice(target: str, a: jax.Array, b: jax.Array, limit, out: tuple) -> jax.Array:
    """`target` over a [..., X, Y] and b [..., Y', Z] as [P, ...] slices, the
    leading axes flattened to P, up to token `limit` of b, giving [..., *out]."""
    lead = a.shape[:-2]
    slices = math.prod(lead)
    flat = (a.reshape(slices, *a.shape[-2:]), b.reshape(slices, *b.shape[-2:]))
    limit = jnp.asarray(b.shape[-2] if limit is None else limit, jnp.int32)
    no_table = jnp.zeros((0, 0), jnp.int32)
    return _call(target, (slices, *out), *flat, no_table, limit).reshape(*lead, *out)


def scores(q: jax.Array, k: jax.Array, limit=None) -> jax.Array:
    """Attention scores float32 [..., M, S] of float32 queries [..., M, H] against
    keys [..., S, H] (the same leading axes; float32, bfloat16 or float16 keys,
    widened as they are read; up to MAX_ROWS queries): one dot product per query
    and key, each slice's keys read once and slices spread over the threads.
    Only keys before `limit` (int32 []; default all) are scored: the rest score
    0, for the caller to mask."""
    lead, (rows, width), length = q.shape[:-2], q.shape[-2:], k.shape[-2]
    if k.shape[:-2] != lead or k.shape[-1] != width:
        raise ValueError(f"queries {q.shape} and keys {k.shape} do not match")
    _check_rows(rows)
    return _per_slice("kvlab_scores", q, k, limit, (rows, length))


def weighted_sum(w: jax.Array, v: jax.Array, limit=None) -> jax.Array:
    """float32 [..., M, H]: float32 weights [..., M, S] over values [..., S, H],
    as `scores` takes them; values and weights from `limit` on count as 0 (the
    kernel never reads them)."""
    lead, (rows, length), width = w.shape[:-2], w.shape[-2:], v.shape[-1]
    if v.shape[:-2] != lead or v.shape[-2] != length:
        raise ValueError(f"weights {w.shape} and values {v.shape} do not match")
    _check_rows(rows)
    return _per_slice("kvlab_weighted_sum", w, v, limit, (rows, width))


def reads_pool(pool: jax.Array, rows: int) -> bool:
    """Whether `pool_scores` and `pool_weighted_sum` take this page pool
    (float32, bfloat16 or float16) and `rows` queries per KV head."""
    return pool.dtype in (jnp.float32, *HALF) and rows <= MAX_ROWS


def _pool_call(target: str, a: jax.Array, pool: jax.Array, pages: jax.Array, limit, out: tuple):
    """`target` over a [B, KH, M, .] and a pool [KH, P, L, H] read through block
    tables pages [B, n], giving [B, KH, M, *out]."""
    batch, heads, rows = a.shape[:3]
    _check_rows(rows)
    flat = a.astype(jnp.float32).reshape(batch * heads, rows, a.shape[3])
    limit = jnp.asarray(limit, jnp.int32)
    shape = (batch * heads, rows, *out)
    called = _call(target, shape, flat, pool, pages.astype(jnp.int32), limit)
    return called.reshape(batch, heads, rows, *out)


def _check_pool(a: jax.Array, pool: jax.Array, pages: jax.Array, length: int, width: int):
    batch, heads = a.shape[:2]
    fits = (
        a.ndim == 4
        and pool.ndim == 4
        and pool.shape[0] == heads
        and pages.ndim == 2
        and pages.shape[0] == batch
        and length <= pages.shape[1] * pool.shape[2]
        and width == pool.shape[3]
    )
    if not fits:
        raise ValueError(
            f"queries or weights {a.shape}, pool {pool.shape} and block tables {pages.shape} "
            f"do not match: expected [B, KH, M, H or S], [KH, P, L, H] and [B, n], "
            f"with S = {length} <= n * L"
        )


def pool_scores(q: jax.Array, pool: jax.Array, pages: jax.Array, length: int, limit) -> jax.Array:
    """Scores float32 [B, KH, M, S] (S = `length`) of queries [B, KH, M, H]
    against a page pool [KH, P, L, H] (float32, or 16 bits widened as read) seen
    through block tables [B, n] (row b's token t in page pages[b, t // L]; an
    entry outside the pool reads the nearest page, clipped as
    kvlab.cache.paged.gather_pages clips it), a page at a time; tokens from
    `limit` on score 0."""
    _check_pool(q, pool, pages, length, q.shape[-1])
    return _pool_call("kvlab_scores", q, pool, pages, limit, (length,))


def pool_weighted_sum(w: jax.Array, pool: jax.Array, pages: jax.Array, limit) -> jax.Array:
    """float32 [B, KH, M, H]: weights [B, KH, M, S] over the pool's tokens as
    pool_scores sees them; weights from `limit` on count as 0 (the kernel never
    reads them)."""
    _check_pool(w, pool, pages, w.shape[-1], pool.shape[-1])
    return _pool_call("kvlab_weighted_sum", w, pool, pages, limit, (pool.shape[-1],))


def reads_owned(x: jax.Array, rows: int) -> bool:
    """Whether `owned_scores` and `owned_weighted_sum` take a pool's keys or
    values `x` [B, S, H] (float32, bfloat16 or float16) read by `rows` queries
    per KV head."""
    return x.dtype in (jnp.float32, *HALF) and rows <= MAX_ROWS


def owned_scores(
    q: jax.Array, keys: jax.Array, tags: jax.Array, scale: float = 1.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax exponents over a pool of keys [B, S, H] whose slot s of row b
    belongs to KV head tags[b, s] mod K (int32 [B, S], an evicting layer's
    position x K + head, or the head itself; negative: to none), each slot
    read by its own head's queries [B, K, M, H] alone:
    (exponents float32 [B, M, S], peaks float32 [B, K, M], listings int32
    [B, K + 2 + S]). Each row's slots are listed by owner: head 0's in slot
    order, then head 1's, ..., then those of no head (the listing: where each
    head's start, then the list). peaks[b, k, m] is the largest of
    scale x q[b, k, m] . keys[b, s] over head k's slots (-inf where it owns
    none); exponents[b, m, j], for the j-th listed slot of a head, is that
    scaled product less the head's peak, and -inf past them."""
    batch, heads, rows, width = q.shape
    _check_rows(rows)
    if keys.ndim != 3 or keys.shape[::2] != (batch, width) or tags.shape != keys.shape[:2]:
        raise ValueError(
            f"queries {q.shape}, keys {keys.shape} and tags {tags.shape} do not match: "
            "[B, K, M, H], [B, S, H] and [B, S]"
        )
    length = keys.shape[1]
    results = (
        jax.ShapeDtypeStruct((batch, rows, length), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads + 2 + length), jnp.int32),
    )
    call = jax.ffi.ffi_call("kvlab_owned_scores", results, vmap_method="sequential")
    return call(q.astype(jnp.float32), keys, tags.astype(jnp.int32), scale=np.float32(scale))


def owned_weighted_sum(
    w: jax.Array, values: jax.Array, listings: jax.Array, heads: int
) -> tuple[jax.Array, jax.Array]:
    """(sums float32 [B, K, M, H], totals float32 [B, K, M]): for each KV head k
    of `heads`, weights [B, M, S] over the pool's values [B, S, H] of the slots
    it owns, and the sum of those weights; the weights in the listed order of
    `listings` (owned_scores' for the same pool: others are refused), those
    past the slots of some head never read."""
    batch, rows, length = w.shape
    _check_rows(rows)
    fits = values.shape[:2] == (batch, length) and listings.shape == (batch, heads + 2 + length)
    if values.ndim != 3 or not fits:
        raise ValueError(
            f"weights {w.shape}, values {values.shape} and listings {listings.shape} do not "
            f"match: [B, M, S], [B, S, H] and [B, K + 2 + S] with K = {heads}"
        )
    results = (
        jax.ShapeDtypeStruct((batch, heads, rows, values.shape[2]), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32),
    )
    call = jax.ffi.ffi_call("kvlab_owned_weighted_sum", results, vmap_method="sequential")
    return call(w.astype(jnp.float32), values, listings.astype(jnp.int32))


def writes_in_place(buffer: jax.Array) -> bool:
    """Whether `write_tokens` takes this buffer: 16-bit floats (which XLA:CPU
    updates through a float32 copy of the whole buffer) in a one-device process
    (XLA would replicate a sharded operand around the call)."""
    return buffer.dtype in HALF and jax.device_count() == 1


def write_tokens(buffer: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """buffer [B, X, S, Y] with token t of new [B, X, T, Y] at slot
    slots[b, x or 0, t] (int32 [B, 1 or X, T]; slots outside 0..S-1 dropped),
    written in place by the native kernel: the new buffer is the old one's
    memory where XLA can donate it (kvlab/cache/placement.write_tokens)."""
    b, x, _, y = buffer.shape if buffer.ndim == 4 else (None,) * 4
    fits = (
        b is not None
        and new.ndim == 4
        and (new.shape[0], new.shape[1], new.shape[3]) == (b, x, y)
        and slots.ndim == 3
        and slots.shape[0] == b
        and slots.shape[1] in (1, x)
        and slots.shape[2] == new.shape[2]
    )
    if not fits:
        raise ValueError(
            f"write_tokens takes buffer [B, X, S, Y], new [B, X, T, Y] and slots "
            f"[B, 1 or X, T]; got {buffer.shape}, {new.shape} and {slots.shape}"
        )
    result = jax.ShapeDtypeStruct(buffer.shape, buffer.dtype)
    call = jax.ffi.ffi_call(
        "kvlab_write_tokens", result, vmap_method="sequential", input_output_aliases={0: 0}
    )
    return call(buffer, new.astype(buffer.dtype), slots.astype(jnp.int32))


def top_k_last(x: jax.Array, k: int) -> jax.Array:
    """int32 [..., k]: the indices of the k largest of float32 x [..., C] in XLA's
    total order (NaN above +inf, +0 above -0), among equals the later first: the
    indices into x of jax.lax.top_k(x[..., ::-1], k). Each row's blocks of 16
    that cannot hold them are skipped (kernels.cc), for a few of them (an
    evicting layer's drops in a step)."""
    if x.dtype != jnp.float32 or not 0 < k <= x.shape[-1]:
        raise ValueError(
            f"top_k_last takes float32 [..., C] and 0 < k <= C; got {x.dtype} {x.shape} and k={k}"
        )
    rows = math.prod(x.shape[:-1])
    result = jax.ShapeDtypeStruct((rows, k), jnp.int32)
    call = jax.ffi.ffi_call("kvlab_top_k_last", result, vmap_method="sequential")
    return call(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], k)


@dataclasses.dataclass(frozen=True)
class Codes:
    """Quantized tokens as kvlab/cache/quant/ stores them, for the kernels.

    payload uint8 [B, KH, S, H * bits / 8] (value j of a byte in bits j*bits..);
    scale, zero [B, KH, S, H / group] (channel=False: a token's `group`
    channels share one) or [B, KH, S / group, H] (channel=True: a channel's
    `group` tokens share one), float32, bfloat16 or float16; zero None
    without zero points. A number is (level - offset) * scale (+ zero), its
    level the integer code or, with fp8, the float8 e4m3 number the byte holds.

    With `pages` (block tables int32 [B, n]) they are page pools instead,
    payload [KH, P, L, H * bits / 8] and scale, zero [KH, P, L or L / group, .],
    row b's token t in page pages[b, t // L] (kvlab/cache/paged.py; a table
    entry outside the pool reads the nearest page, as gather_pages clips it), `length` (S)
    tokens per row.
    """

    payload: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    bits: int
    fp8: bool
    offset: int
    channel: bool
    group: int
    pages: jax.Array | None = None
    length: int | None = None

    @property
    def width(self) -> int:
        return self.payload.shape[-1] * 8 // self.bits

    @property
    def shape(self) -> tuple:
        """[B, KH, S, H]: the tokens the codes hold, as attention reads them."""
        if self.pages is None:
            return (*self.payload.shape[:-1], self.width)
        return (self.pages.shape[0], self.payload.shape[0], self.length, self.width)

    def attributes(self) -> dict:
        return dict(
            bits=np.int64(self.bits),
            fp8=np.int64(self.fp8),
            offset=np.int64(self.offset),
            channel=np.int64(self.channel),
            group=np.int64(self.group),
            has_zero=np.int64(self.zero is not None),
            paged=np.int64(self.pages is not None),
        )


def reads(codes: Codes, rows: int) -> bool:
    """Whether `quant_scores` and `quant_weighted_sum` take these codes and
    `rows` queries (at most MAX_ROWS, scales of a float dtype)."""
    return (
        codes.payload.dtype == jnp.uint8
        and codes.scale.dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
        and rows <= MAX_ROWS
    )


def _quant_call(target: str, x: jax.Array, codes: Codes, limit, out: tuple) -> jax.Array:
    """`target` over x [B, KH, M, .] and the codes as [B * KH, ...] slices (or
    pools), giving [B, KH, M, *out]."""
    lead, rows = x.shape[:-2], x.shape[-2]
    _check_rows(rows)
    slices = math.prod(lead)

    def flat(a):
        return a if codes.pages is not None else a.reshape(slices, *a.shape[-2:])

    zero = codes.zero if codes.zero is not None else codes.scale  # unread without zero points
    table = codes.pages if codes.pages is not None else jnp.zeros((1, 1), jnp.int32)
    result = jax.ShapeDtypeStruct((slices, rows, *out), jnp.float32)
    call = jax.ffi.ffi_call(target, result, vmap_method="sequential")
    operands = (x.astype(jnp.float32).reshape(slices, rows, -1), flat(codes.payload))
    operands += (flat(codes.scale), flat(zero), table.astype(jnp.int32))
    done = call(*operands, jnp.asarray(limit, jnp.int32), **codes.attributes())
    return done.reshape(*lead, rows, *out)


def quant_scores(q: jax.Array, codes: Codes, limit) -> jax.Array:
    """float32 [B, KH, M, S]: queries [B, KH, M, H] against the first `limit`
    (an int32 scalar, may be traced) of the S stored tokens, 0 for the others;
    where `reads(codes, M)`, which the caller checks."""
    b, kh, length, width = codes.shape
    if q.shape[:2] != (b, kh) or q.shape[-1] != width:
        raise ValueError(f"queries {q.shape} and codes of {codes.shape} do not match")
    return _quant_call("kvlab_quant_scores", q, codes, limit, (length,))


def quant_weighted_sum(w: jax.Array, codes: Codes, limit) -> jax.Array:
    """float32 [B, KH, M, H]: weights [B, KH, M, S] over the first `limit`
    stored tokens (the others' weights are not read), as `quant_scores`."""
    b, kh, length, width = codes.shape
    if w.shape[:2] != (b, kh) or w.shape[-1] != length:
        raise ValueError(f"weights {w.shape} and codes of {codes.shape} do not match")
    return _quant_call("kvlab_quant_weighted_sum", w, codes, limit, (width,))
