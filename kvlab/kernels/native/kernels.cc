// kvlab's CPU decode kernels (AVX-512F, float32), called through XLA's FFI
// (kvlab/kernels/native/ffi.py builds this file and registers them). Built without
// AVX-512F (a CPU with AVX2, FMA and F16C alone), avx2.h computes the same intrinsics.
//
// KvlabPanelMatmul: y[M, N] = x[M, K] @ W, with W stored as 32-column panels
// P[N / 32, K, 32] (P[b, k, j] = W[k, 32 b + j]): each panel is one contiguous
// stream, read once per call whatever M is. For each panel and each block of up
// to 8 rows, an 8 x 32 tile of outputs stays in 16 zmm registers while k runs
// over the panel (one broadcast and two FMAs per row and k), so small M costs
// what reading W costs, without the packing a general matrix product does on
// every call. A prompt's further tiles re-read the panel from L2 (96 KiB at
// K = 768) and run at about the cores' FMA rate, as fast as XLA's product of the
// plain layout. Sums run in k order, one FMA each.
//
// KvlabScores and KvlabWeightedSum: decode attention's two products over P
// slices (batch x KV head) of a cache stored in float32, bfloat16 or float16
// (widened in registers), rows' own or page pools through block tables, each
// slice's keys or values read once, up to a limit.
//
// KvlabOwnedScores and KvlabOwnedWeightedSum: the same two products over a pool whose
// slots each belong to one KV head (AdaKV's), each slot read by its own head's queries
// alone (below, "over a pool of owned slots").
//
// KvlabWriteTokens: the cache write, in place (XLA:CPU rewrites a whole 16-bit
// buffer through float32 to update a few tokens of it).
//
// KvlabQuantScores and KvlabQuantWeightedSum: the same over a quantized cache's
// packed codes, a row's own or page pools (below, "over a quantized payload").
//
// KvlabTopKLast: the indices of each row's few largest numbers, among equals the
// later first (an evicting layer's lowest-priority candidates), reading only the
// blocks of the row that can hold them.
//
// Work is split into chunks of about kChunkBytes on XLA's intra-op thread pool;
// the calling thread works too, and a call of one chunk never leaves it.
#include <immintrin.h>
#ifndef __AVX512F__
#include "avx2.h"  // the AVX-512F intrinsics below, on AVX2 (ffi.py builds for the CPU)
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <limits>
#include <type_traits>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;               // columns per panel: two zmm of floats
#ifdef __AVX512F__
constexpr int64_t kRows = 8;  // rows per register tile: 16 of 32 zmm hold their sums
#else
constexpr int64_t kRows = 2;  // avx2.h's vectors take two ymm: 8 of 16 hold the sums
#endif
constexpr int64_t kChunkBytes = 512 * 1024;  // weight bytes per unit of parallel work

// Stored keys and values are read with software prefetches about kAheadBytes ahead (the
// next page of a pool as a run starts). The hardware prefetchers of some CPUs keep too
// few lines in flight for a stream that spends several instructions per line: on a
// 2-core Xeon (Sapphire Rapids class) the bfloat16 scores kernel read 14-15 GB/s without
// them and 25-36 GB/s with them, float32 17 and 20 GB/s. Codes are prefetched a few lines
// at a time as they are read (a burst per block of 64 tokens gained nothing).
constexpr int64_t kAheadBytes = 4096;

// body(i) for i = 0 .. N - 1 as N calls with constant i: a register tile's sums
// indexed by i then stay in registers. (GCC keeps an array indexed by a loop counter
// in memory too, and on AVX2, where avx2.h's vectors are structs, it stores every
// sum back there each step.)
template <typename Body, int... I>
inline __attribute__((always_inline)) void Each(Body&& body, std::integer_sequence<int, I...>) {
  (body(std::integral_constant<int, I>{}), ...);
}
template <int N, typename Body>
inline __attribute__((always_inline)) void Unrolled(Body&& body) {
  Each(body, std::make_integer_sequence<int, N>{});
}

inline void Prefetch(const void* from, int64_t bytes) {
  const char* line = static_cast<const char*>(from);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(line + i, _MM_HINT_T0);
}

// Prefetches the `bytes` that lie kAheadBytes past `at` in a stream, up to `stop`.
inline void AheadIn(const uint8_t* at, int64_t bytes, const uint8_t* stop) {
  const uintptr_t from = reinterpret_cast<uintptr_t>(at) + kAheadBytes;
  const uintptr_t end = reinterpret_cast<uintptr_t>(stop);
  if (from < end) {
    Prefetch(reinterpret_cast<const void*>(from), std::min<int64_t>(bytes, end - from));
  }
}

// A panel is read with prefetches kPanelAhead of its rows (8 KiB) ahead into L2: on a
// 2-core Xeon that read 29-31 GB/s at 1 row and 24-25 GB/s at 8 (L1 prefetches 16 rows
// ahead: 28 and 22-23 GB/s, interleaved in one process).
constexpr int64_t kPanelAhead = 64;

template <int R>
inline void Tile(const float* x, int64_t ldx, const float* panel, int64_t k_len, float* y,
                 int64_t ldy) {
  __m512 lo[R], hi[R];
  Unrolled<R>([&](auto r) { lo[r] = hi[r] = _mm512_setzero_ps(); });
  for (int64_t k = 0; k < k_len; ++k) {
    const float* w = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPanelAhead * kPanel), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPanelAhead * kPanel + 16), _MM_HINT_T1);
    const __m512 w_lo = _mm512_loadu_ps(w), w_hi = _mm512_loadu_ps(w + 16);
    Unrolled<R>([&](auto r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
      lo[r] = _mm512_fmadd_ps(b, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(b, w_hi, hi[r]);
    });
  }
  Unrolled<R>([&](auto r) {
    _mm512_storeu_ps(y + r * ldy, lo[r]);
    _mm512_storeu_ps(y + r * ldy + 16, hi[r]);
  });
}

// Panels [first, last) for all M rows.
void Panels(const float* x, int64_t m_len, int64_t k_len, const float* panels, int64_t n_len,
            int64_t first, int64_t last, float* y) {
  for (int64_t b = first; b < last; ++b) {
    const float* panel = panels + b * k_len * kPanel;
    for (int64_t m = 0; m < m_len; m += kRows) {
      const float* xm = x + m * k_len;
      float* ym = y + m * n_len + b * kPanel;
      switch (std::min(kRows, m_len - m)) {
        case 1: Tile<1>(xm, k_len, panel, k_len, ym, n_len); break;
#ifdef __AVX512F__
        case 2: Tile<2>(xm, k_len, panel, k_len, ym, n_len); break;
        case 3: Tile<3>(xm, k_len, panel, k_len, ym, n_len); break;
        case 4: Tile<4>(xm, k_len, panel, k_len, ym, n_len); break;
        case 5: Tile<5>(xm, k_len, panel, k_len, ym, n_len); break;
        case 6: Tile<6>(xm, k_len, panel, k_len, ym, n_len); break;
        case 7: Tile<7>(xm, k_len, panel, k_len, ym, n_len); break;
#endif
        default: Tile<kRows>(xm, k_len, panel, k_len, ym, n_len); break;
      }
    }
  }
}

// Runs body(first, last) over [0, count) in chunks of `chunk`, on up to the pool's
// threads plus the caller; returns when every chunk is done.
template <typename Body>
void Parallel(ffi::ThreadPool& pool, int64_t count, int64_t chunk, Body body) {
  const int64_t chunks = (count + chunk - 1) / chunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  if (helpers <= 0) {
    body(0, count);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();  // outlives a helper that starts late
  auto work = [state, body, count, chunk, chunks] {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      body(c * chunk, std::min(count, (c + 1) * chunk));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kPanel || pd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] != pd[0] * kPanel) {
    return ffi::Error::InvalidArgument(
        "kvlab panel_matmul: expects x [M, K], panels [N / 32, K, 32] and y [M, N]");
  }
  const int64_t m_len = xd[0], k_len = xd[1], n_len = yd[1], count = pd[0];
  const float* xp = x.typed_data();
  const float* pp = panels.typed_data();
  float* yp = y->typed_data();
  // A panel's work grows with the tiles of rows that read it (a prompt has many): a
  // chunk is about kChunkBytes of panel reads, so a prompt's panels spread one by one.
  const int64_t tiles = std::max<int64_t>(1, (m_len + kRows - 1) / kRows);
  const int64_t panel_bytes = std::max<int64_t>(1, k_len * kPanel * 4);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (panel_bytes * tiles));
  Parallel(pool, count, chunk, [=](int64_t first, int64_t last) {
    Panels(xp, m_len, k_len, pp, n_len, first, last, yp);
  });
  return ffi::Error::Success();
}

// ---- Decode attention's two products, for each of P (batch x KV head) slices:
// scores[p, m, s] = q[p, m, :] . k[p, s, :]  and  out[p, m, :] = sum_s w[p, m, s] v[p, s, :].
// Each slice's keys or values are read once, in order; M (queries per KV head) is small.

inline __mmask16 Tail(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

#ifdef __AVX512F__
// Lane indices folding two vectors of 16 / `group` keys' partial sums (groups of `group`
// lanes) into one vector of twice the keys with half the partials each: FOLD[level][0]
// takes each group's first half, FOLD[level][1] its second; their sum is the fold.
struct Folds {
  alignas(64) int32_t index[4][2][16];
  Folds() {
    for (int level = 0, group = 16; level < 4; ++level, group /= 2) {
      for (int half = 0; half < 2; ++half) {
        for (int lane = 0; lane < 16; ++lane) {
          const int source = lane < 8 ? 0 : 16, j = lane % 8, key = j / (group / 2);
          index[level][half][lane] = source + key * group + half * (group / 2) + j % (group / 2);
        }
      }
    }
  }
};
const Folds kFolds;

__attribute__((always_inline)) inline __m512 Fold(__m512 a, __m512 b, int level) {
  const __m512i lo = _mm512_load_si512(kFolds.index[level][0]);
  const __m512i hi = _mm512_load_si512(kFolds.index[level][1]);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

// 16 vectors of partial sums -> one vector of their 16 totals, in order. Unrolled, so the
// sums stay in registers (a loop over them would keep them in memory).
template <int kLevel, int kCount>
__attribute__((always_inline)) inline void FoldLevel(__m512* acc) {
#pragma GCC unroll 8
  for (int i = 0; i < kCount / 2; ++i) acc[i] = Fold(acc[2 * i], acc[2 * i + 1], kLevel);
}

__attribute__((always_inline)) inline __m512 Totals(__m512* acc) {
  FoldLevel<0, 16>(acc);
  FoldLevel<1, 8>(acc);
  FoldLevel<2, 4>(acc);
  FoldLevel<3, 2>(acc);
  return acc[0];
}
#else
// 8 vectors of 8 partial sums -> their 8 totals, in order: pairwise sums within each
// 128-bit half, then the halves' sums added (avx2.h's Total8 sums one vector so).
inline __m256 Totals8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// 16 vectors of partial sums -> one vector of their 16 totals, in order.
__attribute__((always_inline)) inline __m512 Totals(__m512* acc) {
  __m256 half[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) half[i] = _mm256_add_ps(acc[i].lo, acc[i].hi);
  return {Totals8(half), Totals8(half + 8)};
}
#endif

// Keys and values as float32 rows: numbers h.. of token s (zero past the mask).
struct FloatRows {
  const float* base;
  int64_t ld;
  const void* At(int64_t s) const { return base + s * ld; }
  int64_t Bytes() const { return ld * 4; }  // per token
  inline __m512 operator()(int64_t s, int64_t h, __mmask16 mask) const {
    return _mm512_maskz_loadu_ps(mask, base + s * ld + h);
  }
};

// 16 numbers of 16 bits -> float32: float16 (kF16), else bfloat16 (the high half of a float).
template <bool kF16>
inline __m512 Widen(__m256i raw) {
  if constexpr (kF16) return _mm512_cvtph_ps(raw);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Keys and values stored in 16 bits (bfloat16, or float16 with kF16) as float32 rows.
// The mask is a Tail: its lanes are the first popcount(mask) numbers.
template <bool kF16>
struct HalfRows {
  const uint16_t* base;
  int64_t ld;
  const void* At(int64_t s) const { return base + s * ld; }
  int64_t Bytes() const { return ld * 2; }  // per token
  inline __m512 operator()(int64_t s, int64_t h, __mmask16 mask) const {
    const uint16_t* from = base + s * ld + h;
    if (mask == 0xFFFF) {
      return Widen<kF16>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
    }
    alignas(32) uint16_t tail[16] = {};
    std::memcpy(tail, from, __builtin_popcount(mask) * sizeof(uint16_t));
    return Widen<kF16>(_mm256_load_si256(reinterpret_cast<const __m256i*>(tail)));
  }
};

// Prefetches tokens [s, s + count) of `rows` (FloatRows or HalfRows) that lie below n.
template <typename Rows>
inline void Ahead(const Rows& rows, int64_t s, int64_t count, int64_t n) {
  if (s < n) Prefetch(rows.At(s), (std::min(s + count, n) - s) * rows.Bytes());
}

// A list of tokens of `rows`: token s is rows' token index[s].
template <typename Rows>
struct Gathered {
  Rows rows;
  const int32_t* index;
  const void* At(int64_t s) const { return rows.At(index[s]); }
  int64_t Bytes() const { return rows.Bytes(); }
  inline __m512 operator()(int64_t s, int64_t h, __mmask16 mask) const {
    return rows(index[s], h, mask);
  }
};

// Prefetches listed tokens [s, s + count) below n, one token's bytes each.
template <typename Rows>
inline void Ahead(const Gathered<Rows>& g, int64_t s, int64_t count, int64_t n) {
  for (int64_t i = s; i < std::min(s + count, n); ++i) Prefetch(g.At(i), g.Bytes());
}

// Tokens of `rows` in kAheadBytes, a multiple of `unit`.
template <typename Rows>
inline int64_t AheadTokens(const Rows& rows, int64_t unit) {
  return std::max<int64_t>(1, kAheadBytes / rows.Bytes() / unit) * unit;
}

// out[m * ldo + s] = q[m * ldq, :] . keys(s) for m < m_len, s < n (h_len numbers each).
template <typename Keys>
void ScoresKeys(const float* q, int64_t ldq, const Keys& keys, float* out, int64_t ldo,
                int64_t m_len, int64_t n, int64_t h_len) {
  const int64_t ahead = AheadTokens(keys, 16);
  int64_t s = 0;
#ifdef __AVX512F__
  for (; s + 16 <= n; s += 16) {  // 16 keys at a time, stored as one vector per query
    Ahead(keys, s + ahead, 16, n);
    for (int64_t m = 0; m < m_len; ++m) {
      const float* query = q + m * ldq;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t h = 0; h < h_len; h += 16) {
        const __mmask16 mask = Tail(h_len - h);
        const __m512 qh = _mm512_maskz_loadu_ps(mask, query + h);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qh, keys(s + i, h, mask), acc[i]);
      }
      _mm512_storeu_ps(out + m * ldo + s, Totals(acc));
    }
  }
  for (; s < n; ++s) {  // the last n % 16 keys one by one
    for (int64_t m = 0; m < m_len; ++m) {
      const float* query = q + m * ldq;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t h = 0; h < h_len; h += 16) {
        const __mmask16 mask = Tail(h_len - h);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, query + h), keys(s, h, mask), acc);
      }
      out[m * ldo + s] = _mm512_reduce_add_ps(acc);
    }
  }
#else
  for (; s + 8 <= n; s += 8) {  // 8 keys at a time: 16 ymm registers hold half as many sums
    Ahead(keys, s + ahead, 8, n);
    for (int64_t m = 0; m < m_len; ++m) {
      const float* query = q + m * ldq;
      __m256 acc[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t h = 0; h < h_len; h += 16) {
        const __mmask16 mask = Tail(h_len - h);
        const __m512 qh = _mm512_maskz_loadu_ps(mask, query + h);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m512 key = keys(s + i, h, mask);
          acc[i] = _mm256_fmadd_ps(qh.hi, key.hi, _mm256_fmadd_ps(qh.lo, key.lo, acc[i]));
        }
      }
      _mm256_storeu_ps(out + m * ldo + s, Totals8(acc));
    }
  }
  for (; s < n; ++s) {  // the last n % 8 keys one by one, each summed as in a block
    for (int64_t m = 0; m < m_len; ++m) {
      const float* query = q + m * ldq;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t h = 0; h < h_len; h += 16) {
        const __mmask16 mask = Tail(h_len - h);
        const __m512 qh = _mm512_maskz_loadu_ps(mask, query + h), key = keys(s, h, mask);
        acc = _mm256_fmadd_ps(qh.hi, key.hi, _mm256_fmadd_ps(qh.lo, key.lo, acc));
      }
      out[m * ldo + s] = kv512::Total8(acc);
    }
  }
#endif
}

// A weighted sum's tiles: V vectors of 16 output columns (as many as the head needs, up
// to kTileVectors) for R query rows, sized so that their sums stay in registers (32 zmm
// with AVX-512; avx2.h's vectors take two of AVX2's 16 ymm each).
#ifdef __AVX512F__
constexpr int kTileVectors = 4;
constexpr int TileRows(int) { return 4; }
#else
constexpr int kTileVectors = 2;
constexpr int TileRows(int vectors) { return vectors == 1 ? 4 : 2; }
#endif

// out[r, h0 : h0 + 16 V] (+)= sum_s w[r * ldw + s] values(s)[h0 : h0 + 16 V] for r < R, s < n.
template <int R, int V, typename Values>
void WeightedTile(const float* w, int64_t ldw, const Values& values, int64_t n, float* out,
                  int64_t h_len, int64_t h0, bool accumulate) {
  __m512 acc[R][V];
  __mmask16 mask[V];
  Unrolled<V>([&](auto j) { mask[j] = Tail(std::max<int64_t>(0, h_len - h0 - 16 * j)); });
  Unrolled<R>([&](auto r) {
    Unrolled<V>([&](auto j) {
      acc[r][j] = accumulate ? _mm512_maskz_loadu_ps(mask[j], out + r * h_len + h0 + 16 * j)
                             : _mm512_setzero_ps();
    });
  });
  const int64_t ahead = AheadTokens(values, 1);
  const auto add = [&](__m512(&sums)[R][V], int64_t s) {  // sums += token s's terms
    __m512 row[V];
    Unrolled<V>([&](auto j) { row[j] = values(s, h0 + 16 * j, mask[j]); });
    Unrolled<R>([&](auto r) {
      const __m512 b = _mm512_set1_ps(w[r * ldw + s]);
      Unrolled<V>([&](auto j) { sums[r][j] = _mm512_fmadd_ps(b, row[j], sums[r][j]); });
    });
  };
  int64_t s = 0;
  if constexpr (R * V <= 2) {  // so few sums that each waits on its last FMA: two
    __m512 odd[R][V];          // chains each, the even tokens' and the odd ones'
    Unrolled<R>([&](auto r) { Unrolled<V>([&](auto j) { odd[r][j] = _mm512_setzero_ps(); }); });
    for (; s + 2 <= n; s += 2) {
      Ahead(values, s + ahead, 2, n);
      add(acc, s);
      add(odd, s + 1);
    }
    Unrolled<R>([&](auto r) {
      Unrolled<V>([&](auto j) { acc[r][j] = _mm512_add_ps(acc[r][j], odd[r][j]); });
    });
  }
  for (; s < n; ++s) {
    Ahead(values, s + ahead, 1, n);
    add(acc, s);
  }
  Unrolled<R>([&](auto r) {
    Unrolled<V>([&](auto j) {
      _mm512_mask_storeu_ps(out + r * h_len + h0 + 16 * j, mask[j], acc[r][j]);
    });
  });
}

// WeightedRows' columns h0 .. h0 + 16 V, TileRows(V) query rows at a time.
template <int V, typename Values>
void WeightedColumns(const float* w, int64_t ldw, const Values& values, int64_t n, float* out,
                     int64_t m_len, int64_t h_len, int64_t h0, bool accumulate) {
  constexpr int kRows = TileRows(V);
  for (int64_t m = 0; m < m_len; m += kRows) {
    const float* wm = w + m * ldw;
    float* om = out + m * h_len;
    const int64_t rows = std::min<int64_t>(kRows, m_len - m);
    if (rows == kRows) WeightedTile<kRows, V>(wm, ldw, values, n, om, h_len, h0, accumulate);
    else if (rows == 1) WeightedTile<1, V>(wm, ldw, values, n, om, h_len, h0, accumulate);
    else if (rows == 2) WeightedTile<2, V>(wm, ldw, values, n, om, h_len, h0, accumulate);
    else WeightedTile<3, V>(wm, ldw, values, n, om, h_len, h0, accumulate);
  }
}

// out[m, :] (+)= sum_s w[m * ldw + s] values(s) for m < m_len, s < n (h_len columns).
template <typename Values>
void WeightedRows(const float* w, int64_t ldw, const Values& values, int64_t n, float* out,
                  int64_t m_len, int64_t h_len, bool accumulate) {
  for (int64_t h0 = 0; h0 < h_len; h0 += 16 * kTileVectors) {
    const auto columns = [&](auto vectors) {
      WeightedColumns<decltype(vectors)::value>(w, ldw, values, n, out, m_len, h_len, h0,
                                                accumulate);
    };
    switch (std::min<int64_t>(kTileVectors, (h_len - h0 + 15) / 16)) {
      case 1: columns(std::integral_constant<int, 1>{}); break;
      case 2: columns(std::integral_constant<int, 2>{}); break;
      case 3: columns(std::integral_constant<int, 3>{}); break;
      default: columns(std::integral_constant<int, kTileVectors>{}); break;
    }
  }
}

// The stored keys or values of Scores and Weighted, float32, bfloat16 or float16: [P, S, H],
// or page pools [KH, pages, L, H] read through block tables [B, n] (P = B * KH), slice
// b * KH + kh's token t in page table[b, t / L] (an entry outside the pool reads the
// nearest page, clipped as gather_pages clips it: what it holds is masked).
struct Stored {
  const void* data;
  ffi::DataType type;
  int64_t s_len, h_len;
  const int32_t* table = nullptr;
  int64_t heads = 1, pages = 1, per_page = 1, table_len = 0;

  // run(rows, t, n) for each run of tokens [t, t + n) of slice p below `end` that lies
  // contiguously in memory (one run, or one per page), in order.
  template <typename Run>
  void Runs(int64_t p, int64_t end, Run run) const {
    if (table == nullptr) {
      Rows(p * s_len * h_len, [&](const auto& rows) { run(rows, 0, end); });
      return;
    }
    auto first = [&](int64_t t) {  // the first number of token t's page
      const int64_t page = table[p / heads * table_len + t / per_page];
      return (p % heads * pages + std::clamp<int64_t>(page, 0, pages - 1)) * per_page * h_len;
    };
    const int64_t size = type == ffi::DataType::F32 ? 4 : 2;
    for (int64_t t = 0; t < end; t += per_page) {
      if (const int64_t next = t + per_page; next < end) {
        Prefetch(static_cast<const char*>(data) + first(next) * size,
                 std::min(per_page, end - next) * h_len * size);
      }
      // The run's rows source starts at token t.
      Rows(first(t), [&](const auto& rows) { run(rows, t, std::min(per_page, end - t)); });
    }
  }

  template <typename Run>
  void Rows(int64_t first, Run run) const {
    if (type == ffi::DataType::F32) {
      run(FloatRows{static_cast<const float*>(data) + first, h_len});
    } else if (type == ffi::DataType::F16) {
      run(HalfRows<true>{static_cast<const uint16_t*>(data) + first, h_len});
    } else {
      run(HalfRows<false>{static_cast<const uint16_t*>(data) + first, h_len});
    }
  }
};

// Checks the queries or weights a [P, M, X], the stored tensor b ([P, S, H], or pools
// [KH, pages, L, H] with a table [B, n], P = B * KH and S <= n * L), the limit [] and the
// output [P, M, Y]; S is X (weighted sums) or Y (scores).
ffi::Error ReadStored(const char* name, const ffi::Buffer<ffi::F32>& a, const ffi::AnyBuffer& b,
                      const ffi::Buffer<ffi::S32>& table, const ffi::Buffer<ffi::S32>& limit,
                      ffi::ResultBuffer<ffi::F32>& out, bool scores, Stored* stored) {
  const auto ad = a.dimensions(), bd = b.dimensions(), td = table.dimensions();
  const auto od = out->dimensions();
  const ffi::DataType type = b.element_type();
  const bool paged = bd.size() == 4;
  bool fits = ad.size() == 3 && od.size() == 3 && od[0] == ad[0] && od[1] == ad[1] &&
              (bd.size() == 3 || paged) && limit.dimensions().size() == 0 && td.size() == 2;
  int64_t s_len = 0, h_len = 0;
  if (fits) {
    s_len = scores ? od[2] : ad[2];
    h_len = bd[bd.size() - 1];
    fits = (scores ? ad[2] : od[2]) == h_len;
    if (paged) {
      fits = fits && td[0] * bd[0] == ad[0] && s_len <= td[1] * bd[2] && bd[2] > 0;
    } else {
      fits = fits && bd[0] == ad[0] && bd[1] == s_len;
    }
  }
  if (!fits) {
    return ffi::Error::InvalidArgument(
        std::string(name) +
        (scores ? ": expects q [P, M, H], out [P, M, S]" : ": expects w [P, M, S], out [P, M, H]") +
        ", keys or values [P, S, H] (or pools [KH, pages, L, H] with a table [B, n], "
        "P = B * KH, S <= n * L) and a limit []");
  }
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": stored tokens must be float32, bfloat16 or float16");
  }
  *stored = Stored{b.untyped_data(), type, s_len, h_len};
  if (paged) {
    stored->table = table.typed_data();
    stored->heads = bd[0];
    stored->pages = bd[1];
    stored->per_page = bd[2];
    stored->table_len = td[1];
  }
  return ffi::Error::Success();
}

int64_t Limit(const ffi::Buffer<ffi::S32>& limit, int64_t s_len) {
  return std::clamp<int64_t>(limit.typed_data()[0], 0, s_len);
}

// Work per slice in bytes, for the chunks of parallel work.
int64_t SliceChunk(const Stored& k, int64_t end) {
  const int64_t bytes = end * k.h_len * (k.type == ffi::DataType::F32 ? 4 : 2);
  return std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes));
}

// Scores of the first `limit` tokens; those past it are 0 (the caller masks them).
ffi::Error Scores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                  ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> limit,
                  ffi::ResultBuffer<ffi::F32> out) {
  Stored keys;
  if (auto error = ReadStored("kvlab scores", q, k, table, limit, out, true, &keys);
      error.failure()) {
    return error;
  }
  const int64_t m_len = q.dimensions()[1], s_len = keys.s_len, h_len = keys.h_len;
  const int64_t end = Limit(limit, s_len);
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  Parallel(pool, q.dimensions()[0], SliceChunk(keys, end), [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      float* scores = op + p * m_len * s_len;
      keys.Runs(p, end, [&](const auto& rows, int64_t t, int64_t n) {
        ScoresKeys(qp + p * m_len * h_len, h_len, rows, scores + t, s_len, m_len, n, h_len);
      });
      for (int64_t m = 0; m < m_len; ++m)
        std::fill(scores + m * s_len + end, scores + (m + 1) * s_len, 0.0f);
    }
  });
  return ffi::Error::Success();
}

// Sums over the first `limit` tokens; weights past it are never read.
ffi::Error Weighted(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer v,
                    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> limit,
                    ffi::ResultBuffer<ffi::F32> out) {
  Stored values;
  if (auto error = ReadStored("kvlab weighted_sum", w, v, table, limit, out, false, &values);
      error.failure()) {
    return error;
  }
  const int64_t m_len = w.dimensions()[1], s_len = values.s_len, h_len = values.h_len;
  const int64_t end = Limit(limit, s_len);
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  Parallel(pool, w.dimensions()[0], SliceChunk(values, end), [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      float* sums = op + p * m_len * h_len;
      std::fill(sums, sums + m_len * h_len, 0.0f);
      values.Runs(p, end, [&](const auto& rows, int64_t t, int64_t n) {
        WeightedRows(wp + p * m_len * s_len + t, s_len, rows, n, sums, m_len, h_len, true);
      });
    }
  });
  return ffi::Error::Success();
}

// ---- Over a pool of owned slots: AdaKV's K heads share one pool of slots per row
// (kvlab/cache/evict/layers.py), slot s of row b holding a token of KV head tags[b, s]
// mod K (the layer's tag: position x K + head; a negative tag: no token). Only that
// head's M queries read the slot, so a slot costs M products instead of the K x M a
// masked read of the pool costs. Each (row, head)'s slots are listed in slot order and
// read through the list (Gathered), in segments of about kChunkBytes spread over the
// threads; each segment's peaks and sums are combined in segment order, so the results
// do not depend on the number of threads.

// owner[s] = tags[s] mod heads, or heads where tags[s] < 0 (no head), for s < s_len:
// a quotient in double precision (exact to within one for any int32), corrected.
void Owners(const int32_t* tags, int64_t s_len, int64_t heads, int32_t* owner) {
  const __m512d inverse = _mm512_set1_pd(1.0 / static_cast<double>(heads));
  const __m512i count = _mm512_set1_epi32(static_cast<int32_t>(heads));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t s = 0; s < s_len; s += 16) {
    const __mmask16 tail = Tail(s_len - s);
    const __m512i tag = _mm512_maskz_loadu_epi32(tail, tags + s);
    const auto quotient = [&](__m256i half) {
      const __m512d x = _mm512_mul_pd(_mm512_cvtepi32_pd(half), inverse);
      return _mm512_cvttpd_epi32(_mm512_roundscale_pd(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
    };
    const __m512i q = _mm512_inserti64x4(
        _mm512_castsi256_si512(quotient(_mm512_castsi512_si256(tag))),
        quotient(_mm512_extracti64x4_epi64(tag, 1)), 1);
    __m512i r = _mm512_sub_epi32(tag, _mm512_mullo_epi32(q, count));
    r = _mm512_mask_add_epi32(r, _mm512_cmplt_epi32_mask(r, zero), r, count);
    r = _mm512_mask_sub_epi32(r, _mm512_cmpge_epi32_mask(r, count), r, count);
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epi32_mask(tag, zero), count);
    _mm512_mask_storeu_epi32(owner + s, tail, r);
  }
}

// A row's listing, int32 [K + 2 + S]: where each head's slots start in the list (then
// where the slots of no head start, and S), then the list: the row's slots grouped by
// owner, each head's in slot order, the slots of no head last (never read). OwnedScores
// writes it and OwnedWeighted reads it back.
void List(const int32_t* owner, int64_t s_len, int64_t heads, int32_t* listing) {
  // One pass per bucket (heads + 1, the last for slots of no head: an owner at or past
  // heads, compared unsigned), each slot's index stored where its bucket's mask holds (a
  // compressing store): no counter that each slot's write waits on.
  int32_t* list = listing + heads + 2;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i count = _mm512_set1_epi32(static_cast<int32_t>(heads));
  int32_t at = 0;
  for (int64_t k = 0; k <= heads; ++k) {
    listing[k] = at;
    const __m512i want = _mm512_set1_epi32(static_cast<int32_t>(k));
    for (int64_t s = 0; s < s_len; s += 16) {
      const __mmask16 tail = Tail(s_len - s);
      const __m512i o = _mm512_maskz_loadu_epi32(tail, owner + s);
      const __mmask16 mine = k < heads ? _mm512_mask_cmpeq_epi32_mask(tail, o, want)
                                       : _mm512_mask_cmpge_epu32_mask(tail, o, count);
      const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(s)));
#ifdef __AVX512F__
      _mm512_mask_compressstoreu_epi32(list + at, mine, index);
#else  // the list's ints past `at` are written in order, so whole stores may run past it
      if (at + 16 <= s_len)
        kv512::CompressStoreRoom(list + at, mine, index);
      else
        _mm512_mask_compressstoreu_epi32(list + at, mine, index);
#endif
      at += __builtin_popcount(mine);
    }
  }
  listing[heads + 1] = at;
}

// Whether a row's listing is one List could write: starts rising from 0 to S, the list
// slots of the row (16 at a time, compared unsigned: a negative one is past S; a scalar
// loop cost about 3 us a call over a 4k-slot pool, a decode step's tenth on mha.py:tiny).
bool Listed(const int32_t* listing, int64_t s_len, int64_t heads) {
  if (listing[0] != 0 || listing[heads + 1] != s_len) return false;
  for (int64_t k = 0; k <= heads; ++k)
    if (listing[k + 1] < listing[k]) return false;
  const int32_t* list = listing + heads + 2;
  const __m512i bound = _mm512_set1_epi32(static_cast<int32_t>(s_len));
  __mmask16 outside = 0;
  for (int64_t j = 0; j < listing[heads]; j += 16) {
    const __mmask16 tail = Tail(listing[heads] - j);
    const __m512i slot = _mm512_maskz_loadu_epi32(tail, list + j);
    outside |= _mm512_mask_cmpge_epu32_mask(tail, slot, bound);
  }
  return outside == 0;
}

// The work over a pool's listings [B, K + 2 + S], cut in segments (row, head, begin, end)
// of at most `span` listed slots of one head (this thread's list, reused between calls).
struct Segment {
  int64_t row, head, begin, end;
};

const std::vector<Segment>& Segments(const int32_t* listings, int64_t b_len, int64_t s_len,
                                     int64_t heads, int64_t span) {
  thread_local std::vector<Segment> segments;
  segments.clear();
  for (int64_t b = 0; b < b_len; ++b) {
    const int32_t* starts = listings + b * (heads + 2 + s_len);
    for (int64_t k = 0; k < heads; ++k)
      for (int64_t j = starts[k]; j < starts[k + 1]; j += span)
        segments.push_back({b, k, j, std::min<int64_t>(j + span, starts[k + 1])});
  }
  return segments;
}

// Segments per unit of parallel work: about kChunkBytes of listed rows each, so a
// pool smaller than that is read by the calling thread alone (waking a helper costs
// more than a small pool's products).
int64_t SegmentChunk(const std::vector<Segment>& segments, const Stored& rows) {
  int64_t listed = 0;
  for (const Segment& seg : segments) listed += seg.end - seg.begin;
  const int64_t bytes = listed * rows.h_len * (rows.type == ffi::DataType::F32 ? 4 : 2);
  const int64_t units = std::max<int64_t>(1, bytes / kChunkBytes);
  return std::max<int64_t>(1, (static_cast<int64_t>(segments.size()) + units - 1) / units);
}

// This thread's buffer of at least `size` floats, kept between calls.
float* Buffer(int64_t size) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// Checks a pool's stored tensor [B, S, H] (`fits`: and the other operands' shapes).
ffi::Error ReadOwned(const char* name, const ffi::AnyBuffer& stored, bool fits, Stored* rows) {
  const auto sd = stored.dimensions();
  if (!fits || sd.size() != 3) {
    return ffi::Error::InvalidArgument(
        std::string(name) +
        ": expects queries [B, K, M, H], keys [B, S, H] and tags [B, S] (exponents "
        "[B, M, S], peaks [B, K, M], listings [B, K + 2 + S]), or weights [B, M, S], values "
        "[B, S, H] and listings (sums [B, K, M, H], totals [B, K, M])");
  }
  const ffi::DataType type = stored.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": stored tokens must be float32, bfloat16 or float16");
  }
  *rows = Stored{stored.untyped_data(), type, sd[1], sd[2]};
  return ffi::Error::Success();
}

int64_t OwnedSpan(const Stored& rows) {
  const int64_t bytes = rows.h_len * (rows.type == ffi::DataType::F32 ? 4 : 2);
  return std::max<int64_t>(16, kChunkBytes / std::max<int64_t>(1, bytes));
}

// OwnedScores lists each row's slots by owner (List) and gives the softmax's exponents in
// that listed order; OwnedWeighted takes the listings back and the weights in the same
// order, so a slot's exponent and weight are read and written in place, never scattered.
//
// listings[b]: row b's listing (List); peaks[b, k, m]: the largest of scale x
// q[b, k, m, :] . keys[b, s, :] over head k's slots s (-inf where it owns no slot);
// exponents[b, m, j]: for the j-th listed slot of row b, that scaled product less its
// head's peak (-inf past the slots of some head).
ffi::Error OwnedScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                       ffi::Buffer<ffi::S32> tags, float scale, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> peaks, ffi::ResultBuffer<ffi::S32> listings) {
  const auto qd = q.dimensions(), kd = k.dimensions(), od = out->dimensions();
  const auto pd = peaks->dimensions(), ld = listings->dimensions();
  const auto wd = tags.dimensions();
  const bool fits = qd.size() == 4 && kd.size() == 3 && od.size() == 3 && pd.size() == 3 &&
                    ld.size() == 2 && wd.size() == 2 && kd[0] == qd[0] && kd[2] == qd[3] &&
                    wd[0] == qd[0] && wd[1] == kd[1] && od[0] == qd[0] && od[1] == qd[2] &&
                    od[2] == kd[1] && pd[0] == qd[0] && pd[1] == qd[1] && pd[2] == qd[2] &&
                    ld[0] == qd[0] && ld[1] == qd[1] + 2 + kd[1];
  Stored keys;
  if (auto error = ReadOwned("kvlab owned_scores", k, fits, &keys); error.failure()) {
    return error;
  }
  const int64_t b_len = qd[0], heads = qd[1], m_len = qd[2], h_len = qd[3], s_len = keys.s_len;
  const int64_t row_len = heads + 2 + s_len;
  int32_t* lp = listings->typed_data();
  thread_local std::vector<int32_t> owners;
  owners.resize(s_len);
  for (int64_t b = 0; b < b_len; ++b) {
    Owners(tags.typed_data() + b * s_len, s_len, heads, owners.data());
    List(owners.data(), s_len, heads, lp + b * row_len);
  }
  const std::vector<Segment>& segments = Segments(lp, b_len, s_len, heads, OwnedSpan(keys));
  const int64_t items = segments.size();
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float* top = Buffer(items * m_len);
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  // Each segment's scaled products, in place, and its largest.
  Parallel(pool, items, SegmentChunk(segments, keys), [&](int64_t first, int64_t last) {
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t i = first; i < last; ++i) {
      const Segment& seg = segments[i];
      const int32_t* index = lp + seg.row * row_len + heads + 2 + seg.begin;
      const int64_t n = seg.end - seg.begin;
      float* listed = op + seg.row * m_len * s_len + seg.begin;
      keys.Rows(seg.row * s_len * h_len, [&](const auto& rows) {
        const Gathered<std::decay_t<decltype(rows)>> slots{rows, index};
        ScoresKeys(qp + (seg.row * heads + seg.head) * m_len * h_len, h_len, slots, listed,
                   s_len, m_len, n, h_len);
      });
      for (int64_t m = 0; m < m_len; ++m) {
        float* row = listed + m * s_len;
        __m512 best = _mm512_set1_ps(kNone);
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 mask = Tail(n - j);
          const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + j), factor);
          _mm512_mask_storeu_ps(row + j, mask, x);
          best = _mm512_mask_max_ps(best, mask, best, x);
        }
        top[i * m_len + m] = _mm512_reduce_max_ps(best);
      }
    }
  });
  float* pp = peaks->typed_data();
  std::fill(pp, pp + b_len * heads * m_len, kNone);
  for (int64_t i = 0; i < items; ++i) {
    const Segment& seg = segments[i];
    float* peak = pp + (seg.row * heads + seg.head) * m_len;
    for (int64_t m = 0; m < m_len; ++m) peak[m] = std::max(peak[m], top[i * m_len + m]);
  }
  // Less each head's peak; -inf past a row's slots of some head.
  for (int64_t b = 0; b < b_len; ++b)
    for (int64_t m = 0; m < m_len; ++m) {
      float* row = op + (b * m_len + m) * s_len;
      std::fill(row + lp[b * row_len + heads], row + s_len, kNone);
    }
  for (const Segment& seg : segments) {
    const float* peak = pp + (seg.row * heads + seg.head) * m_len;
    for (int64_t m = 0; m < m_len; ++m) {
      float* row = op + (seg.row * m_len + m) * s_len;
      const __m512 shift = _mm512_set1_ps(peak[m]);
      for (int64_t j = seg.begin; j < seg.end; j += 16) {
        const __mmask16 mask = Tail(seg.end - j);
        const __m512 x = _mm512_maskz_loadu_ps(mask, row + j);
        _mm512_mask_storeu_ps(row + j, mask, _mm512_sub_ps(x, shift));
      }
    }
  }
  return ffi::Error::Success();
}

// sums[b, k, m, :] = sum over head k's slots s of w[b, m, j] values[b, s, :] and totals[b,
// k, m] the sum of those weights, slot s the j-th listed of row b in `listings` (as
// OwnedScores gives them); weights past the slots of some head are never read.
ffi::Error OwnedWeighted(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer v,
                         ffi::Buffer<ffi::S32> listings, ffi::ResultBuffer<ffi::F32> out,
                         ffi::ResultBuffer<ffi::F32> totals) {
  const auto wd = w.dimensions(), vd = v.dimensions(), od = out->dimensions();
  const auto td = totals->dimensions(), ld = listings.dimensions();
  const bool fits = wd.size() == 3 && vd.size() == 3 && od.size() == 4 && td.size() == 3 &&
                    ld.size() == 2 && vd[0] == wd[0] && vd[1] == wd[2] && od[0] == wd[0] &&
                    od[2] == wd[1] && od[3] == vd[2] && td[0] == wd[0] && td[1] == od[1] &&
                    td[2] == wd[1] && ld[0] == wd[0] && ld[1] == od[1] + 2 + vd[1];
  Stored values;
  if (auto error = ReadOwned("kvlab owned_weighted_sum", v, fits, &values); error.failure()) {
    return error;
  }
  const int64_t b_len = wd[0], heads = od[1], m_len = wd[1], h_len = od[3], s_len = values.s_len;
  const int64_t row_len = heads + 2 + s_len;
  const int32_t* lp = listings.typed_data();
  for (int64_t b = 0; b < b_len; ++b)
    if (!Listed(lp + b * row_len, s_len, heads)) {
      return ffi::Error::InvalidArgument(
          "kvlab owned_weighted_sum: the listings are not owned_scores' for this pool");
    }
  const std::vector<Segment>& segments = Segments(lp, b_len, s_len, heads, OwnedSpan(values));
  const int64_t items = segments.size();
  const int64_t size = m_len * (h_len + 1);  // a segment's sums, then its totals
  float* partial = Buffer(items * size);
  const float* wp = w.typed_data();
  Parallel(pool, items, SegmentChunk(segments, values), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const Segment& seg = segments[i];
      const int32_t* index = lp + seg.row * row_len + heads + 2 + seg.begin;
      const int64_t n = seg.end - seg.begin;
      const float* listed = wp + seg.row * m_len * s_len + seg.begin;
      float* sums = partial + i * size;
      for (int64_t m = 0; m < m_len; ++m) {
        const float* row = listed + m * s_len;
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16)
          total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(Tail(n - j), row + j));
        sums[m_len * h_len + m] = _mm512_reduce_add_ps(total);
      }
      values.Rows(seg.row * s_len * h_len, [&](const auto& rows) {
        const Gathered<std::decay_t<decltype(rows)>> slots{rows, index};
        WeightedRows(listed, s_len, slots, n, sums, m_len, h_len, false);
      });
    }
  });
  float* op = out->typed_data();
  float* tp = totals->typed_data();
  std::fill(op, op + b_len * heads * m_len * h_len, 0.0f);
  std::fill(tp, tp + b_len * heads * m_len, 0.0f);
  for (int64_t i = 0; i < items; ++i) {
    const Segment& seg = segments[i];
    const float* sums = partial + i * size;
    float* o = op + (seg.row * heads + seg.head) * m_len * h_len;
    float* t = tp + (seg.row * heads + seg.head) * m_len;
    for (int64_t j = 0; j < m_len * h_len; ++j) o[j] += sums[j];
    for (int64_t m = 0; m < m_len; ++m) t[m] += sums[m_len * h_len + m];
  }
  return ffi::Error::Success();
}

// ---- The one cache write (kvlab/cache/placement.py's write_tokens) done in place:
// buffer [B, X, S, Y] takes fresh [B, X, T, Y], token t of row b (and group x) at slot
// slots[b, x or 0, t] (slots [B, E, T], E = X or 1); slots outside 0..S-1 are dropped.
// Entries are copied as bytes, any element type. XLA:CPU updates a 16-bit float buffer
// through a float32 copy of all of it; this writes only the new tokens.
ffi::Error WriteTokens(ffi::AnyBuffer buffer, ffi::AnyBuffer fresh, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> out) {
  const auto bd = buffer.dimensions(), fd = fresh.dimensions(), sd = slots.dimensions();
  if (bd.size() != 4 || fd.size() != 4 || sd.size() != 3 || fd[0] != bd[0] || fd[1] != bd[1] ||
      fd[3] != bd[3] || sd[0] != bd[0] || sd[2] != fd[2] || (sd[1] != 1 && sd[1] != bd[1]) ||
      fresh.element_type() != buffer.element_type() || out->size_bytes() != buffer.size_bytes()) {
    return ffi::Error::InvalidArgument(
        "kvlab write_tokens: expects buffer [B, X, S, Y], fresh [B, X, T, Y] of its type and "
        "slots [B, 1 or X, T]");
  }
  uint8_t* to = static_cast<uint8_t*>(out->untyped_data());
  if (to != buffer.untyped_data()) std::memcpy(to, buffer.untyped_data(), buffer.size_bytes());
  const int64_t b_len = bd[0], x_len = bd[1], s_len = bd[2], t_len = fd[2];
  const int64_t count = b_len * x_len * s_len * bd[3];
  const int64_t row = count == 0 ? 0 : buffer.size_bytes() / count * bd[3];  // bytes per token
  const uint8_t* from = static_cast<const uint8_t*>(fresh.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t b = 0; b < b_len; ++b)
    for (int64_t x = 0; x < x_len; ++x)
      for (int64_t t = 0; t < t_len; ++t) {
        const int64_t s = slot[(b * sd[1] + (sd[1] == 1 ? 0 : x)) * t_len + t];
        if (s < 0 || s >= s_len) continue;
        std::memcpy(to + ((b * x_len + x) * s_len + s) * row,
                    from + ((b * x_len + x) * t_len + t) * row, row);
      }
  return ffi::Error::Success();
}

// ---- A top-k of a few, among equals the later first: out[r, i] is the index of row r's
// i-th largest of x[r, :] in XLA's total order of floats (a NaN above +inf, +0 above -0,
// a negative NaN below -inf: the order of the signed integer below), among equal
// numbers the later index first, as jax.lax.top_k of the reversed row. A first pass
// takes the largest key of each block of 16; the k-th largest of those bounds the
// answer from below (k blocks hold a key at least as large), so the second pass skips
// every block whose largest key is below it or does not beat the k-th best so far, in
// any order of the row. The best k are kept sorted by insertion, a later equal one
// first. Keys equal to the k-th best do not enter (long runs of equal keys, the slots
// an empty or a full pool fills with -inf, cost one compare each), so the last places,
// those of the k-th best key, are then given to its latest occurrences, read from the
// row's end.

inline int32_t OrderKey(int32_t bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }

inline __m512i OrderKeys(const int32_t* at) {
  const __m512i bits = _mm512_loadu_si512(at);
  return _mm512_xor_si512(
      bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(0x7FFFFFFF)));
}

ffi::Error TopKLast(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2 || od[0] != xd[0] || od[1] > xd[1]) {
    return ffi::Error::InvalidArgument(
        "kvlab top_k_last: expects x [R, C] and out [R, k] with k <= C");
  }
  const int64_t rows = xd[0], length = xd[1], k = od[1];
  if (k == 0) return ffi::Error::Success();
  const int64_t blocks = length / 16;
  std::vector<int32_t> best(k), where(k), peaks(blocks), order(blocks);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* row = reinterpret_cast<const int32_t*>(x.typed_data() + r * length);
    for (int64_t b = 0; b < blocks; ++b) peaks[b] = _mm512_reduce_max_epi32(OrderKeys(row + 16 * b));
    int32_t bound = std::numeric_limits<int32_t>::min();
    if (blocks >= k) {
      order = peaks;
      std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), std::greater<>());
      bound = order[k - 1];
    }
    int64_t held = 0;
    auto consider = [&](int64_t j) {
      const int32_t key = OrderKey(row[j]);
      if (held == k && key <= best[k - 1]) return;
      int64_t at = held < k ? held++ : k - 1;
      for (; at > 0 && best[at - 1] <= key; --at) {  // past equal keys: the later first
        best[at] = best[at - 1];
        where[at] = where[at - 1];
      }
      best[at] = key;
      where[at] = static_cast<int32_t>(j);
    };
    int64_t j = 0;
    for (; j + 16 <= length; j += 16) {
      const int32_t peak = peaks[j / 16];
      if (peak < bound || (held == k && peak <= best[k - 1])) continue;
      for (int64_t i = j; i < j + 16; ++i) consider(i);
    }
    for (; j < length; ++j) consider(j);
    // The places of the k-th best key go to its latest occurrences, latest first.
    const int32_t last = best[k - 1];
    int64_t fill = 0;
    while (best[fill] > last) ++fill;
    const __m512i wanted = _mm512_set1_epi32(last);
    for (j = length; fill < k && j > 0;) {
      if (j >= 16 && !_mm512_cmpeq_epi32_mask(OrderKeys(row + j - 16), wanted)) {
        j -= 16;
        continue;
      }
      for (const int64_t stop = j >= 16 ? j - 16 : 0; j > stop && fill < k;) {
        --j;
        if (OrderKey(row[j]) == last) where[fill++] = static_cast<int32_t>(j);
      }
    }
    std::memcpy(out->typed_data() + r * k, where.data(), k * sizeof(int32_t));
  }
  return ffi::Error::Success();
}

// ---- The same two products over a quantized payload (kvlab/cache/quant.py's layout):
// codes uint8[P, S, H * bits / 8], value j of a byte in bits j*bits.., and scales and zero
// points [P, S, H / group] (token axis: a token's channels share one) or [P, S / group, H]
// (channel axis: a channel's tokens share one) in float32, bfloat16 or float16, or the
// same as page pools read through block tables (Payload). A number is (level - offset) *
// scale (+ zero), level the integer code or the float8 e4m3 value. On the channel axis a
// group's scales fold into the queries and the sums, as quant.PayloadReader folds them.
// Blocks of up to 64 tokens are dequantized into a float32 scratch that stays in the
// core's caches and multiplied there, or, for one query row over whole 16-byte chunks,
// read straight into the products (Direct); the payload is read once and no widened copy
// is made. Only the first `limit` tokens are read (the rest of the scores are 0); the work
// is split into (slice, run of tokens) items of a fixed size, so sums run in the same
// order on any number of threads.

constexpr int64_t kItemNumbers = int64_t{1} << 17;  // stored numbers per unit of parallel work

enum class ScaleType { kF32, kBF16, kF16 };

struct Codes {
  int64_t bits;    // 8, 4 or 2
  bool fp8;        // float8 e4m3 codes (8 bits), else unsigned integer levels
  float offset;    // subtracted from integer levels (symmetric codes)
  bool channel;    // scale groups run along tokens (channel axis), else along channels
  int64_t group;   // numbers per scale group
  bool has_zero;
  ScaleType scale_type;
};

struct Payload {
  const uint8_t* codes;
  const void* scale;
  const void* zero;
  int64_t s_len, h_len, bytes;  // tokens per slice, numbers per token, bytes per token
  Codes c;
  // Page pools (table set): codes [KH, pages, L, bytes] and scales [KH, pages, L or L / group,
  // groups]; slice b * KH + kh reads token t from page table[b, t / L], an entry outside
  // the pool reading the nearest page, clipped as gather_pages clips it (masked).
  const int32_t* table = nullptr;
  int64_t heads = 1, pages = 1, per_page = 1, table_len = 0;

  int64_t Groups() const { return c.channel ? h_len : h_len / c.group; }  // scales per row

  // Row `row` of the slice in an array of `per_slice` rows per slice, or of `per_page`
  // rows per page.
  int64_t Row(int64_t slice, int64_t row, int64_t per_slice, int64_t rows_per_page) const {
    if (table == nullptr) return slice * per_slice + row;
    int64_t page = table[slice / heads * table_len + row / rows_per_page];
    page = std::clamp<int64_t>(page, 0, pages - 1);
    return (slice % heads * pages + page) * rows_per_page + row % rows_per_page;
  }
  const uint8_t* TokenCodes(int64_t slice, int64_t t) const {
    return codes + Row(slice, t, s_len, per_page) * bytes;
  }
  // The first entry of scale row `row` (a token, or a group of tokens on the channel axis).
  int64_t ScaleEntry(int64_t slice, int64_t row) const {
    const int64_t per = c.channel ? c.group : 1;
    return Row(slice, row, s_len / per, per_page / per) * Groups();
  }
  // Blocks stay within a page, so their codes and scale rows are contiguous.
  int64_t BlockEnd(int64_t t, int64_t end) const {
    return table == nullptr ? end : std::min(end, (t / per_page + 1) * per_page);
  }
  // The end of the codes a block [t, end) of a work item [., s1) may prefetch from: the
  // item's (its slice's codes are contiguous), or in a pool the block's page's.
  const uint8_t* Stop(int64_t slice, int64_t t, int64_t end, int64_t s1) const {
    return table == nullptr ? TokenCodes(slice, s1) : TokenCodes(slice, t) + (end - t) * bytes;
  }
  // Prefetches what a block [t, end) will read outside the codes' stream: its codes when
  // they start a page, and its scale rows (token axis: the tokens', channel axis: the
  // group's when t starts one).
  void AheadBlock(int64_t slice, int64_t t, int64_t end) const {
    if (table != nullptr && t % per_page == 0) Prefetch(TokenCodes(slice, t), (end - t) * bytes);
    if (c.channel && t % c.group != 0) return;
    const int64_t row = c.channel ? t / c.group : t, rows = c.channel ? 1 : end - t;
    const int64_t size = c.scale_type == ScaleType::kF32 ? 4 : 2;
    const int64_t first = ScaleEntry(slice, row) * size, count = rows * Groups() * size;
    Prefetch(static_cast<const char*>(scale) + first, count);
    if (c.has_zero) Prefetch(static_cast<const char*>(zero) + first, count);
  }
};

// dst[i] = float(src[first + i]) for i < n, then 16 zeros (vector loads may run past n).
void ToFloat(const void* src, ScaleType type, int64_t first, int64_t n, float* dst) {
  int64_t i = 0;
  if (type == ScaleType::kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + first, n * sizeof(float));
    i = n;
  } else {
    const uint16_t* half = static_cast<const uint16_t*>(src) + first;
    alignas(32) uint16_t tail[16];
    for (; i < n; i += 16) {
      const uint16_t* from = half + i;
      if (i + 16 > n) {
        std::memset(tail, 0, sizeof(tail));
        std::memcpy(tail, from, (n - i) * sizeof(uint16_t));
        from = tail;
      }
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
      _mm512_storeu_ps(dst + i, type == ScaleType::kF16 ? Widen<true>(raw) : Widen<false>(raw));
    }
    i = n;
  }
  std::memset(dst + i, 0, 16 * sizeof(float));
}

// float8 e4m3fn bits (one per int32 lane) -> float32: 1 sign, 4 exponent (bias 7) and
// 3 mantissa bits, subnormal below exponent 1, NaN at 0x7F, no infinities.
inline __m512 Fp8(__m512i bits) {
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F));
  const __m512i exponent = _mm512_srli_epi32(magnitude, 3);
  const __m512i mantissa = _mm512_and_si512(magnitude, _mm512_set1_epi32(7));
  // normal: exponent + 120 and the mantissa's 3 bits at the top of float32's 23
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal =
      _mm512_mul_ps(_mm512_cvtepi32_ps(mantissa), _mm512_set1_ps(1.0f / 512));  // m * 2^-9
  __m512 value = _mm512_mask_blend_ps(
      _mm512_cmpeq_epi32_mask(exponent, _mm512_setzero_si512()), normal, subnormal);
  value = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F)),
                               value, _mm512_set1_ps(__builtin_nanf("")));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

// Checks the operands against each other and the attributes; fills `p` on success.
// Dense: codes [P, S, H * bits / 8], scales [P, S or S / group, .]; paged (a table
// [B, n] with P = B * KH): codes [KH, pages, L, H * bits / 8], scales [KH, pages, L or
// L / group, .], S tokens per row (s_len) within the table's n * L.
ffi::Error ReadPayload(const char* name, int64_t slices, int64_t s_len, int64_t h_len,
                       const ffi::Buffer<ffi::U8>& codes, const ffi::AnyBuffer& scale,
                       const ffi::AnyBuffer& zero, const ffi::Buffer<ffi::S32>& table,
                       int64_t bits, int64_t fp8, int64_t offset, int64_t channel, int64_t group,
                       int64_t has_zero, int64_t paged, Payload* p) {
  const auto cd = codes.dimensions(), sd = scale.dimensions(), zd = zero.dimensions();
  const auto td = table.dimensions();
  const auto type = scale.element_type();
  const bool known_bits = bits == 8 || (!fp8 && (bits == 4 || bits == 2));
  if (!known_bits || group < 1 || (fp8 && (offset || has_zero))) {
    return ffi::Error::InvalidArgument(std::string(name) + ": unknown code format");
  }
  const std::string shapes = paged ? "codes [KH, pages, L, H * bits / 8], scales [KH, pages, "
                                     ".. , ..] and a table [B, n] with P = B * KH"
                                   : "codes [P, S, H * bits / 8] and scales [P, ., .]";
  const size_t rank = paged ? 4 : 3;
  if (cd.size() != rank || sd.size() != rank || cd[rank - 1] * 8 != h_len * bits ||
      (paged && (td.size() != 2 || td[0] * cd[0] != slices || sd[0] != cd[0] || sd[1] != cd[1] ||
                 s_len > td[1] * cd[2])) ||
      (!paged && (cd[0] != slices || sd[0] != slices || cd[1] != s_len))) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + shapes + " expected");
  }
  const int64_t rows = paged ? cd[2] : s_len;  // tokens per page, or per slice
  const bool rows_ok = channel ? (rows % group == 0 && (!paged || s_len % group == 0) &&
                                  sd[rank - 2] == rows / group && sd[rank - 1] == h_len)
                               : (h_len % group == 0 && sd[rank - 2] == rows &&
                                  sd[rank - 1] == h_len / group);
  if (!rows_ok) {
    return ffi::Error::InvalidArgument(std::string(name) + ": scales do not fit the codes");
  }
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument(std::string(name) + ": scales must be float32, " +
                                       "bfloat16 or float16");
  }
  bool zero_ok = zero.element_type() == type && zd.size() == sd.size();
  for (size_t i = 0; zero_ok && i < sd.size(); ++i) zero_ok = zd[i] == sd[i];
  if (has_zero && !zero_ok) {
    return ffi::Error::InvalidArgument(std::string(name) + ": zero points must match the scales");
  }
  const ScaleType scale_type = type == ffi::DataType::F32    ? ScaleType::kF32
                               : type == ffi::DataType::BF16 ? ScaleType::kBF16
                                                             : ScaleType::kF16;
  *p = Payload{codes.typed_data(), scale.untyped_data(), zero.untyped_data(), s_len, h_len,
               cd[rank - 1], Codes{bits, fp8 != 0, static_cast<float>(offset), channel != 0,
                                   group, has_zero != 0, scale_type}};
  if (paged) {
    p->table = table.typed_data();
    p->heads = cd[0], p->pages = cd[1], p->per_page = cd[2], p->table_len = td[1];
  }
  return ffi::Error::Success();
}

// Scratch of one work item: dequantized rows, converted scales and shifts, the folded
// queries or a group's sums [M, H], their biases or weight totals [M], a permuted row.
struct Scratch {
  int64_t block, ld;  // tokens per block (a multiple of 16) and the rows' stride
  const uint8_t* stop = nullptr;  // the block's codes may be prefetched up to here
  std::unique_ptr<float[]> rows, scale, shift, folded, bias, spare;
  Scratch(const Payload& p, int64_t m_len) {
    ld = (p.h_len + 15) / 16 * 16;
    block = std::max<int64_t>(16, std::min<int64_t>(64, 4096 / ld / 16 * 16));
    const int64_t scales = (block + 2) * std::max<int64_t>(p.h_len, 16) + 16;
    rows.reset(new float[block * ld]);
    scale.reset(new float[scales]);
    shift.reset(new float[scales]);
    folded.reset(new float[m_len * ld]);
    bias.reset(new float[m_len]);
    spare.reset(new float[ld]);
  }
};

// Converts scale rows [first_row, first_row + rows) of the slice into s.scale and their
// shifts zero - offset * scale (what a level of 0 stands for) into s.shift.
void ConvertScales(const Payload& p, int64_t slice, int64_t first_row, int64_t rows,
                   Scratch& s) {
  const int64_t groups = p.Groups(), first = p.ScaleEntry(slice, first_row);
  const int64_t n = rows * groups;
  ToFloat(p.scale, p.c.scale_type, first, n, s.scale.get());
  if (p.c.has_zero) {
    ToFloat(p.zero, p.c.scale_type, first, n, s.shift.get());
  } else {
    std::memset(s.shift.get(), 0, (n + 16) * sizeof(float));
  }
  if (p.c.offset != 0)
    for (int64_t i = 0; i < n; ++i) s.shift[i] -= p.c.offset * s.scale[i];
}

// The scale (or shift) of each lane of vector v of a token whose per-group row is `row`
// (token axis): group (16 v + l) / group for lane l.
struct TokenScales {
  bool uniform;  // one group per vector: a broadcast
  std::unique_ptr<int64_t[]> base;
  std::unique_ptr<int32_t[]> index;  // [vectors][16], relative to base
  TokenScales(int64_t h_len, int64_t group) {
    const int64_t vectors = (h_len + 15) / 16;
    uniform = group % 16 == 0;
    base.reset(new int64_t[vectors]);
    index.reset(new int32_t[vectors * 16]);
    for (int64_t v = 0; v < vectors; ++v) {
      base[v] = 16 * v / group;
      for (int l = 0; l < 16; ++l)
        index[v * 16 + l] = static_cast<int32_t>((16 * v + l) / group - base[v]);
    }
  }
  inline __m512 Get(const float* row, int64_t v) const {
    if (uniform) return _mm512_set1_ps(row[base[v]]);
    return _mm512_permutexvar_ps(_mm512_loadu_si512(index.get() + 16 * v),
                                 _mm512_loadu_ps(row + base[v]));
  }
};

// Codes of one 16-byte chunk (as 16 int32 lanes) -> the levels of its 16 * per_byte
// numbers in order, 16 per vector (value j of a byte sits in bits j*bits..).
template <int kBits>
struct Unpack {
  static constexpr int kPerByte = 8 / kBits;
  __m512i index[kPerByte], shift, low_bits;
  Unpack() {
    alignas(64) int32_t lanes[16], by[16];
    for (int u = 0; u < kPerByte; ++u) {
      // 4 bits: vector u interleaves lanes 8 u.. of the low nibbles (0..15) and the high
      // ones (16..31); 2 bits: lane l of vector u is byte 4 u + l / 4, shifted by 2 (l % 4).
      for (int l = 0; l < 16; ++l)
        lanes[l] = kBits == 4 ? 8 * u + l / 2 + 16 * (l % 2) : u * 16 / kPerByte + l / kPerByte;
      index[u] = _mm512_load_si512(lanes);
    }
    for (int l = 0; l < 16; ++l) by[l] = (l % kPerByte) * kBits;
    shift = _mm512_load_si512(by);
    low_bits = _mm512_set1_epi32((1 << kBits) - 1);
  }
  inline void Levels(__m512i bytes, __m512i* out) const {
    if (kBits == 8) {
      out[0] = bytes;
    } else if (kBits == 4) {
      const __m512i low = _mm512_and_si512(bytes, low_bits), high = _mm512_srli_epi32(bytes, 4);
      for (int u = 0; u < kPerByte; ++u) out[u] = _mm512_permutex2var_epi32(low, index[u], high);
    } else {
      for (int u = 0; u < kPerByte; ++u)
        out[u] = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_permutexvar_epi32(index[u], bytes), shift), low_bits);
    }
  }
};

// n tokens' codes (`bytes` each) as float32 rows[n][ld] of h_len numbers: levels, and on
// the token axis (kScaled) times each token's scale plus its shift (rows [n, groups] of
// scale and shift; kUniform: one group per vector). A token's whole 16-byte chunks take
// the straight path; its last bytes, when h_len * bits / 8 is no multiple of 16, a copy.
template <int kBits, bool kFp8, bool kScaled, bool kUniform>
void Rows(const uint8_t* codes, int64_t bytes, int64_t h_len, int64_t n, const float* scale,
          const float* shift, int64_t groups, const TokenScales& token, float* rows,
          int64_t ld, const uint8_t* stop) {
  constexpr int kPerByte = 8 / kBits;
  const Unpack<kBits> unpack;
  const int64_t whole = bytes / 16;
  auto finish = [&](__m512i level, const float* sc, const float* sh, int64_t v) {
    __m512 x = kFp8 ? Fp8(level) : _mm512_cvtepi32_ps(level);
    if (!kScaled) return x;
    if (kUniform) {
      const int64_t g = token.base[v];
      return _mm512_fmadd_ps(x, _mm512_set1_ps(sc[g]), _mm512_set1_ps(sh[g]));
    }
    return _mm512_fmadd_ps(x, token.Get(sc, v), token.Get(sh, v));
  };
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* c = codes + t * bytes;
    AheadIn(c, bytes, stop);
    float* row = rows + t * ld;
    const float* sc = scale + t * groups;
    const float* sh = shift + t * groups;
    for (int64_t k = 0; k < whole; ++k) {
      __m512i level[kPerByte];
      unpack.Levels(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * k))),
          level);
#pragma GCC unroll 4
      for (int u = 0; u < kPerByte; ++u)
        _mm512_storeu_ps(row + 16 * (k * kPerByte + u), finish(level[u], sc, sh, k * kPerByte + u));
    }
    if (whole * 16 < bytes) {
      alignas(16) uint8_t tail[16] = {};
      std::memcpy(tail, c + 16 * whole, bytes - 16 * whole);
      __m512i level[kPerByte];
      unpack.Levels(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tail))),
                    level);
      for (int u = 0; u < kPerByte && 16 * (whole * kPerByte + u) < h_len; ++u)
        _mm512_storeu_ps(row + 16 * (whole * kPerByte + u),
                         finish(level[u], sc, sh, whole * kPerByte + u));
    }
  }
}

// Tokens [t, t + n) of the slice as float32 rows in s.rows (token axis: their scales
// converted and applied; channel axis: levels, the caller folds the group's scales in).
template <int kBits, bool kFp8>
void BlockRows(const Payload& p, const TokenScales& token, int64_t slice, int64_t t, int64_t n,
               Scratch& s) {
  const uint8_t* codes = p.TokenCodes(slice, t);
  if (p.c.channel) {
    Rows<kBits, kFp8, false, true>(codes, p.bytes, p.h_len, n, nullptr, nullptr, 0, token,
                                   s.rows.get(), s.ld, s.stop);
    return;
  }
  ConvertScales(p, slice, t, n, s);
  if (token.uniform) {
    Rows<kBits, kFp8, true, true>(codes, p.bytes, p.h_len, n, s.scale.get(), s.shift.get(),
                                  p.Groups(), token, s.rows.get(), s.ld, s.stop);
  } else {
    Rows<kBits, kFp8, true, false>(codes, p.bytes, p.h_len, n, s.scale.get(), s.shift.get(),
                                   p.Groups(), token, s.rows.get(), s.ld, s.stop);
  }
}

// One query row against whole 16-byte chunks of codes (h_len * bits / 8 a multiple of
// 16): the products read the codes straight into registers, with no rows in between.
// kScaled (token axis, one scale group per vector): each token's scale and shift applied.
// kPhased (4 bits): a chunk's numbers are taken in phase order, vector p holding the codes
// in bits 4p.. of its 16 bytes (numbers p, p + 2, ...), which costs a shift or a mask
// instead of a permutation; the query and the sums are permuted to match (`spare`: h_len
// floats), once per call.
template <int kBits, bool kFp8, bool kScaled, bool kPhased>
struct Direct {
  static constexpr int kPerByte = 8 / kBits;
  const Unpack<kBits> unpack;
  const uint8_t* codes;  // the block's first token
  int64_t bytes;         // per token
  const float* scale;    // kScaled: the block's converted scale rows and shifts [n, groups]
  const float* shift;
  int64_t groups;
  const TokenScales& token;
  float* spare;
  const uint8_t* stop;  // codes may be prefetched up to here

  // Vector u of chunk k of token s: numbers 16 (k * per_byte + u).., or in phase order.
  inline void Chunk(int64_t s, int64_t k, __m512* x) const {
    const __m512i bytes16 = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + s * bytes + 16 * k)));
    __m512i level[kPerByte];
    if (kPhased) {
      for (int u = 0; u < kPerByte; ++u) {
        const __m512i shifted = u ? _mm512_srli_epi32(bytes16, u * kBits) : bytes16;
        level[u] = u + 1 < kPerByte ? _mm512_and_si512(shifted, unpack.low_bits) : shifted;
      }
    } else {
      unpack.Levels(bytes16, level);
    }
#pragma GCC unroll 4
    for (int u = 0; u < kPerByte; ++u) {
      x[u] = kFp8 ? Fp8(level[u]) : _mm512_cvtepi32_ps(level[u]);
      if (kScaled) {  // phased: the chunk is one scale group
        const int64_t g = s * groups + token.base[k * kPerByte + (kPhased ? 0 : u)];
        x[u] = _mm512_fmadd_ps(x[u], _mm512_set1_ps(scale[g]), _mm512_set1_ps(shift[g]));
      }
    }
  }

  // h_len numbers (whole chunks of 32) into phase order (`back`: out of it): a chunk's
  // even numbers, then its odd ones.
  void Permute(const float* from, float* to, int64_t h_len, bool back) const {
    alignas(64) int32_t lanes[2][16];
    for (int l = 0; l < 16; ++l) {
      for (int p = 0; p < 2; ++p)
        lanes[p][l] = back ? 8 * p + l / 2 + 16 * (l % 2) : 2 * l + p;
    }
    const __m512i first = _mm512_load_si512(lanes[0]), second = _mm512_load_si512(lanes[1]);
    for (int64_t c = 0; c < h_len; c += 32) {
      const __m512 a = _mm512_loadu_ps(from + c), b = _mm512_loadu_ps(from + c + 16);
      _mm512_storeu_ps(to + c, _mm512_permutex2var_ps(a, first, b));
      _mm512_storeu_ps(to + c + 16, _mm512_permutex2var_ps(a, second, b));
    }
  }

  // out[s] = q . token s for s < n.
  void Scores(const float* q, int64_t n, float* out) const {
    const int64_t chunks = bytes / 16;
    if (kPhased) {
      Permute(q, spare, chunks * 16 * kPerByte, false);
      q = spare;
    }
    int64_t s = 0;
    for (; s + 16 <= n; s += 16) {
      AheadIn(codes + s * bytes, 16 * bytes, stop);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t k = 0; k < chunks; ++k) {
        __m512 qv[kPerByte];
        for (int u = 0; u < kPerByte; ++u) qv[u] = _mm512_loadu_ps(q + 16 * (k * kPerByte + u));
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          __m512 x[kPerByte];
          Chunk(s + i, k, x);
          for (int u = 0; u < kPerByte; ++u) acc[i] = _mm512_fmadd_ps(qv[u], x[u], acc[i]);
        }
      }
      _mm512_storeu_ps(out + s, Totals(acc));
    }
    for (; s < n; ++s) {
      AheadIn(codes + s * bytes, bytes, stop);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < chunks; ++k) {
        __m512 x[kPerByte];
        Chunk(s, k, x);
        for (int u = 0; u < kPerByte; ++u)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * (k * kPerByte + u)), x[u], acc);
      }
      out[s] = _mm512_reduce_add_ps(acc);
    }
  }

  // out[:] (+)= sum_s w[s] token s, for s < n: 8 vectors of columns per pass.
  void Weighted(const float* w, int64_t n, float* out, bool accumulate) const {
    constexpr int kChunks = 8 / kPerByte;
    const int64_t chunks = bytes / 16, h_len = chunks * 16 * kPerByte;
    float* natural = out;
    if (kPhased) {  // the sums in phase order, put back in order at the end
      if (accumulate) Permute(out, spare, h_len, false);
      out = spare;
    }
    for (int64_t k0 = 0; k0 < chunks; k0 += kChunks) {
      const int64_t count = std::min<int64_t>(kChunks, chunks - k0);
      __m512 acc[kChunks][kPerByte];
      for (int c = 0; c < kChunks; ++c)
        for (int u = 0; u < kPerByte; ++u)
          acc[c][u] = accumulate && c < count
                          ? _mm512_loadu_ps(out + 16 * ((k0 + c) * kPerByte + u))
                          : _mm512_setzero_ps();
      for (int64_t s = 0; s < n; ++s) {
        if (k0 == 0) AheadIn(codes + s * bytes, bytes, stop);
        const __m512 weight = _mm512_set1_ps(w[s]);
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          if (c >= count) break;
          __m512 x[kPerByte];
          Chunk(s, k0 + c, x);
          for (int u = 0; u < kPerByte; ++u) acc[c][u] = _mm512_fmadd_ps(weight, x[u], acc[c][u]);
        }
      }
      for (int c = 0; c < count; ++c)
        for (int u = 0; u < kPerByte; ++u)
          _mm512_storeu_ps(out + 16 * ((k0 + c) * kPerByte + u), acc[c][u]);
    }
    if (kPhased) Permute(spare, natural, h_len, true);
  }
};

// Calls run(direct) with the Direct reader of tokens [t, t + n) of the slice (token axis:
// their scales converted first).
template <int kBits, bool kFp8, typename Run>
void WithDirect(const Payload& p, const TokenScales& token, int64_t slice, int64_t t, int64_t n,
                Scratch& s, Run run) {
  const uint8_t* codes = p.TokenCodes(slice, t);
  constexpr bool kPhased = kBits == 4;
  if (p.c.channel) {
    run(Direct<kBits, kFp8, false, kPhased>{{}, codes, p.bytes, nullptr, nullptr, 0, token,
                                            s.spare.get(), s.stop});
    return;
  }
  ConvertScales(p, slice, t, n, s);
  auto scaled = [&](auto phased) {
    run(Direct<kBits, kFp8, true, decltype(phased)::value>{
        {}, codes, p.bytes, s.scale.get(), s.shift.get(), p.Groups(), token, s.spare.get(),
        s.stop});
  };
  // Phase order takes a chunk's 16 * per_byte numbers from one scale group.
  if (kPhased && p.c.group % (16 * (8 / kBits)) == 0) {
    scaled(std::bool_constant<kPhased>());
  } else {
    scaled(std::false_type());
  }
}

// Whether one query row reads the codes directly: whole chunks, one scale group per vector.
bool Directly(const Payload& p, const TokenScales& token, int64_t m_len) {
  return m_len == 1 && p.bytes % 16 == 0 && (p.c.channel || token.uniform);
}

// Channel axis, group j: folded[m, :] = q[m, :] * scale_j and bias[m] = q[m, :] . shift_j,
// so a score is folded[m] . levels + bias[m].
void FoldQueries(const Payload& p, const float* q, int64_t m_len, int64_t slice, int64_t j,
                 Scratch& s) {
  ConvertScales(p, slice, j, 1, s);
  for (int64_t m = 0; m < m_len; ++m) {
    __m512 bias = _mm512_setzero_ps();
    for (int64_t h = 0; h < p.h_len; h += 16) {
      const __mmask16 mask = Tail(p.h_len - h);
      const __m512 x = _mm512_maskz_loadu_ps(mask, q + m * p.h_len + h);
      _mm512_storeu_ps(s.folded.get() + m * s.ld + h,
                       _mm512_mul_ps(x, _mm512_maskz_loadu_ps(mask, s.scale.get() + h)));
      bias = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(mask, s.shift.get() + h), bias);
    }
    s.bias[m] = _mm512_reduce_add_ps(bias);
  }
}

// Scores of the slice's queries q [M, H] against tokens [s0, s1) into out (stride S), a
// block of tokens dequantized into float32 rows at a time.
template <int kBits, bool kFp8>
void ScoresItem(const Payload& p, const float* q, int64_t m_len, int64_t slice, int64_t s0,
                int64_t s1, float* out, const TokenScales& token) {
  Scratch s(p, m_len);
  for (int64_t t = s0; t < s1;) {
    int64_t end = p.BlockEnd(t, std::min(s1, t + s.block));
    const float* query = q;
    int64_t ldq = p.h_len;
    if (p.c.channel) {
      const int64_t j = t / p.c.group;
      end = std::min(end, (j + 1) * p.c.group);
      if (t == s0 || t % p.c.group == 0) FoldQueries(p, q, m_len, slice, j, s);
      query = s.folded.get(), ldq = s.ld;
    }
    s.stop = p.Stop(slice, t, end, s1);
    if (end < s1) p.AheadBlock(slice, end, p.BlockEnd(end, std::min(s1, end + s.block)));
    if (Directly(p, token, m_len)) {
      WithDirect<kBits, kFp8>(p, token, slice, t, end - t, s,
                              [&](const auto& keys) { keys.Scores(query, end - t, out + t); });
    } else {
      BlockRows<kBits, kFp8>(p, token, slice, t, end - t, s);
      ScoresKeys(query, ldq, FloatRows{s.rows.get(), s.ld}, out + t, p.s_len, m_len, end - t,
                 p.h_len);
    }
    if (p.c.channel)
      for (int64_t m = 0; m < m_len; ++m)
        for (int64_t i = t; i < end; ++i) out[m * p.s_len + i] += s.bias[m];
    t = end;
  }
}

// sum [M, H] = the slice's weights w [M, S] (stride S) over tokens [s0, s1), as ScoresItem.
template <int kBits, bool kFp8>
void WeightedItem(const Payload& p, const float* w, int64_t m_len, int64_t slice, int64_t s0,
                  int64_t s1, float* sum, const TokenScales& token) {
  Scratch s(p, m_len);
  const int64_t h_len = p.h_len;
  std::fill(sum, sum + m_len * h_len, 0.0f);
  float* acc = s.folded.get();    // channel axis: the group's sum of weighted levels [M, H]
  float* weights = s.bias.get();  // and of its weights [M]
  // Channel axis: sum += scale_j * acc + weights * shift_j for the group just finished.
  auto flush = [&](int64_t j) {
    ConvertScales(p, slice, j, 1, s);
    for (int64_t m = 0; m < m_len; ++m) {
      const __m512 total = _mm512_set1_ps(weights[m]);
      for (int64_t h = 0; h < h_len; h += 16) {
        const __mmask16 mask = Tail(h_len - h);
        float* o = sum + m * h_len + h;
        __m512 x = _mm512_maskz_loadu_ps(mask, o);
        x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, acc + m * h_len + h),
                            _mm512_maskz_loadu_ps(mask, s.scale.get() + h), x);
        x = _mm512_fmadd_ps(total, _mm512_maskz_loadu_ps(mask, s.shift.get() + h), x);
        _mm512_mask_storeu_ps(o, mask, x);
      }
    }
  };
  for (int64_t t = s0; t < s1;) {
    int64_t end = p.BlockEnd(t, std::min(s1, t + s.block));
    const bool start = p.c.channel && (t == s0 || t % p.c.group == 0);
    if (p.c.channel) end = std::min(end, (t / p.c.group + 1) * p.c.group);
    s.stop = p.Stop(slice, t, end, s1);
    if (end < s1) p.AheadBlock(slice, end, p.BlockEnd(end, std::min(s1, end + s.block)));
    const float* wt = w + t;
    float* into = p.c.channel ? acc : sum;
    if (Directly(p, token, m_len)) {
      WithDirect<kBits, kFp8>(p, token, slice, t, end - t, s,
                              [&](const auto& values) { values.Weighted(wt, end - t, into, !start); });
    } else {
      BlockRows<kBits, kFp8>(p, token, slice, t, end - t, s);
      WeightedRows(wt, p.s_len, FloatRows{s.rows.get(), s.ld}, end - t, into, m_len, h_len,
                   !start);
    }
    if (p.c.channel) {
      for (int64_t m = 0; m < m_len; ++m) {
        float total = start ? 0.0f : weights[m];
        for (int64_t i = 0; i < end - t; ++i) total += wt[m * p.s_len + i];
        weights[m] = total;
      }
      if (end == s1 || end % p.c.group == 0) flush((end - 1) / p.c.group);
    }
    t = end;
  }
}

using ScoresFn = void (*)(const Payload&, const float*, int64_t, int64_t, int64_t, int64_t,
                          float*, const TokenScales&);
using WeightedFn = ScoresFn;

template <template <int, bool> class Pick>
auto ByFormat(const Codes& c) {
  if (c.fp8) return Pick<8, true>::kFn;
  if (c.bits == 8) return Pick<8, false>::kFn;
  if (c.bits == 4) return Pick<4, false>::kFn;
  return Pick<2, false>::kFn;
}
template <int kBits, bool kFp8>
struct PickScores {
  static constexpr ScoresFn kFn = ScoresItem<kBits, kFp8>;
};
template <int kBits, bool kFp8>
struct PickWeighted {
  static constexpr WeightedFn kFn = WeightedItem<kBits, kFp8>;
};

// Runs body(item, slice, s0, s1) for every slice's tokens [0, limit) in runs of `span`
// tokens, on the pool.
template <typename Body>
void OverItems(ffi::ThreadPool& pool, int64_t slices, int64_t limit, int64_t span, Body body) {
  const int64_t per_slice = (limit + span - 1) / span;
  Parallel(pool, slices * per_slice, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t slice = item / per_slice, s0 = item % per_slice * span;
      body(item, slice, s0, std::min(limit, s0 + span));
    }
  });
}

// Tokens per work item: about kItemNumbers numbers, whole scale groups on the channel axis.
int64_t Span(const Payload& p) {
  const int64_t unit = p.c.channel ? p.c.group : 16;
  return std::max<int64_t>(1, kItemNumbers / p.h_len / unit) * unit;
}

ffi::Error QuantScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> codes,
                       ffi::AnyBuffer scale, ffi::AnyBuffer zero, ffi::Buffer<ffi::S32> table,
                       ffi::Buffer<ffi::S32> limit, ffi::ResultBuffer<ffi::F32> out, int64_t bits,
                       int64_t fp8, int64_t offset, int64_t channel, int64_t group,
                       int64_t has_zero, int64_t paged) {
  const auto qd = q.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || od.size() != 3 || od[0] != qd[0] || od[1] != qd[1] ||
      limit.dimensions().size() != 0) {
    return ffi::Error::InvalidArgument("kvlab quant_scores: expects q [P, M, H] and a limit []");
  }
  Payload p;
  if (auto error = ReadPayload("kvlab quant_scores", qd[0], od[2], qd[2], codes, scale, zero,
                               table, bits, fp8, offset, channel, group, has_zero, paged, &p);
      error.failure()) {
    return error;
  }
  const int64_t m_len = qd[1], s_len = p.s_len, end = Limit(limit, s_len);
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  for (int64_t row = 0; row < qd[0] * m_len; ++row)  // tokens past the limit score 0
    std::fill(op + row * s_len + end, op + (row + 1) * s_len, 0.0f);
  const TokenScales token(p.h_len, p.c.channel ? 16 : p.c.group);
  const ScoresFn item = ByFormat<PickScores>(p.c);
  OverItems(pool, qd[0], end, Span(p), [&](int64_t, int64_t slice, int64_t s0, int64_t s1) {
    item(p, qp + slice * m_len * p.h_len, m_len, slice, s0, s1, op + slice * m_len * s_len,
         token);
  });
  return ffi::Error::Success();
}

ffi::Error QuantWeighted(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::U8> codes,
                         ffi::AnyBuffer scale, ffi::AnyBuffer zero, ffi::Buffer<ffi::S32> table,
                         ffi::Buffer<ffi::S32> limit, ffi::ResultBuffer<ffi::F32> out,
                         int64_t bits, int64_t fp8, int64_t offset, int64_t channel,
                         int64_t group, int64_t has_zero, int64_t paged) {
  const auto wd = w.dimensions(), od = out->dimensions();
  if (wd.size() != 3 || od.size() != 3 || od[0] != wd[0] || od[1] != wd[1] ||
      limit.dimensions().size() != 0) {
    return ffi::Error::InvalidArgument(
        "kvlab quant_weighted_sum: expects w [P, M, S], out [P, M, H] and a limit []");
  }
  Payload p;
  if (auto error = ReadPayload("kvlab quant_weighted_sum", wd[0], wd[2], od[2], codes, scale,
                               zero, table, bits, fp8, offset, channel, group, has_zero, paged,
                               &p);
      error.failure()) {
    return error;
  }
  const int64_t slices = wd[0], m_len = wd[1], s_len = p.s_len, size = m_len * p.h_len;
  const int64_t end = Limit(limit, s_len), span = Span(p);
  const int64_t per_slice = (end + span - 1) / span;
  // Each item's sum apart, then added in item order: the same order on any thread count.
  std::unique_ptr<float[]> partial(new float[std::max<int64_t>(1, slices * per_slice * size)]);
  const TokenScales token(p.h_len, p.c.channel ? 16 : p.c.group);
  const WeightedFn item = ByFormat<PickWeighted>(p.c);
  const float* wp = w.typed_data();
  OverItems(pool, slices, end, span, [&](int64_t i, int64_t slice, int64_t s0, int64_t s1) {
    item(p, wp + slice * m_len * s_len, m_len, slice, s0, s1, partial.get() + i * size, token);
  });
  float* op = out->typed_data();
  std::fill(op, op + slices * size, 0.0f);
  for (int64_t slice = 0; slice < slices; ++slice)
    for (int64_t i = 0; i < per_slice; ++i) {
      const float* sum = partial.get() + (slice * per_slice + i) * size;
      for (int64_t j = 0; j < size; ++j) op[slice * size + j] += sum[j];
    }
  return ffi::Error::Success();
}

}  // namespace

#define KVLAB_BINARY_F32                   \
  ffi::Ffi::Bind()                         \
      .Ctx<ffi::ThreadPool>()              \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabPanelMatmul, PanelMatmul, KVLAB_BINARY_F32);

#define KVLAB_STORED_BINDING               \
  ffi::Ffi::Bind()                         \
      .Ctx<ffi::ThreadPool>()              \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::AnyBuffer>()               \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabScores, Scores, KVLAB_STORED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabWeightedSum, Weighted, KVLAB_STORED_BINDING);

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabOwnedScores, OwnedScores,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabOwnedWeightedSum, OwnedWeighted,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabWriteTokens, WriteTokens,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabTopKLast, TopKLast,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

#define KVLAB_QUANT_BINDING                \
  ffi::Ffi::Bind()                         \
      .Ctx<ffi::ThreadPool>()              \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::U8>>()         \
      .Arg<ffi::AnyBuffer>()               \
      .Arg<ffi::AnyBuffer>()               \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()        \
      .Attr<int64_t>("bits")               \
      .Attr<int64_t>("fp8")                \
      .Attr<int64_t>("offset")             \
      .Attr<int64_t>("channel")            \
      .Attr<int64_t>("group")              \
      .Attr<int64_t>("has_zero")           \
      .Attr<int64_t>("paged")

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabQuantScores, QuantScores, KVLAB_QUANT_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabQuantWeightedSum, QuantWeighted, KVLAB_QUANT_BINDING);
