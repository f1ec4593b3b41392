// kvlab's CPU decode kernels (AVX-512F, float32), called through XLA's FFI
// (kvlab/native/__init__.py builds this file and registers them).
//
// KvlabPanelMatmul: y[M, N] = x[M, K] @ W, with W stored as 32-column panels
// P[N / 32, K, 32] (P[b, k, j] = W[k, 32 b + j]): each panel is one contiguous
// stream, read once per call whatever M is. For each panel and each block of up
// to 8 rows, an 8 x 32 tile of outputs stays in 16 zmm registers while k runs
// over the panel (one broadcast and two FMAs per row and k), so small M costs
// what reading W costs, without the packing a general matrix product does on
// every call. Sums run in k order, one FMA each.
//
// KvlabScores and KvlabWeightedSum: decode attention's two products over P
// slices (batch x KV head) of a cache, each slice's keys or values read once.
//
// Work is split into chunks of about kChunkBytes on XLA's intra-op thread pool;
// the calling thread works too, and a call of one chunk never leaves it.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;               // columns per panel: two zmm of floats
constexpr int64_t kRows = 8;                 // rows per register tile
constexpr int64_t kChunkBytes = 512 * 1024;  // weight bytes per unit of parallel work

template <int R>
inline void Tile(const float* x, int64_t ldx, const float* panel, int64_t k_len, float* y,
                 int64_t ldy) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    const float* w = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kPanel + 16), _MM_HINT_T0);
    const __m512 w_lo = _mm512_loadu_ps(w), w_hi = _mm512_loadu_ps(w + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
      lo[r] = _mm512_fmadd_ps(b, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(b, w_hi, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, lo[r]);
    _mm512_storeu_ps(y + r * ldy + 16, hi[r]);
  }
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
        case 2: Tile<2>(xm, k_len, panel, k_len, ym, n_len); break;
        case 3: Tile<3>(xm, k_len, panel, k_len, ym, n_len); break;
        case 4: Tile<4>(xm, k_len, panel, k_len, ym, n_len); break;
        case 5: Tile<5>(xm, k_len, panel, k_len, ym, n_len); break;
        case 6: Tile<6>(xm, k_len, panel, k_len, ym, n_len); break;
        case 7: Tile<7>(xm, k_len, panel, k_len, ym, n_len); break;
        default: Tile<8>(xm, k_len, panel, k_len, ym, n_len); break;
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
  const int64_t panel_bytes = std::max<int64_t>(1, k_len * kPanel * 4);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / panel_bytes);
  Parallel(pool, count, chunk, [=](int64_t first, int64_t last) {
    Panels(xp, m_len, k_len, pp, n_len, first, last, yp);
  });
  return ffi::Error::Success();
}

// ---- Decode attention's two products, for each of P (batch x KV head) slices:
// scores[p, m, s] = q[p, m, :] . k[p, s, :]  and  out[p, m, :] = sum_s w[p, m, s] v[p, s, :].
// Each slice's keys or values are read once, in order; M (queries per KV head) is small.

inline __mmask16 Tail(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

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

inline __m512 Fold(__m512 a, __m512 b, int level) {
  const __m512i lo = _mm512_load_si512(kFolds.index[level][0]);
  const __m512i hi = _mm512_load_si512(kFolds.index[level][1]);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

// 16 vectors of partial sums -> one vector of their 16 totals, in order.
inline __m512 Totals(__m512* acc) {
  for (int level = 0, count = 16; level < 4; ++level, count /= 2)
    for (int i = 0; i < count / 2; ++i) acc[i] = Fold(acc[2 * i], acc[2 * i + 1], level);
  return acc[0];
}

void ScoresSlice(const float* q, const float* k, float* out, int64_t m_len, int64_t s_len,
                 int64_t h_len) {
  int64_t s = 0;
  for (; s + 16 <= s_len; s += 16) {  // 16 keys at a time, stored as one vector per query
    const float* keys = k + s * h_len;
    for (int64_t m = 0; m < m_len; ++m) {
      const float* query = q + m * h_len;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t h = 0; h < h_len; h += 16) {
        const __mmask16 mask = Tail(h_len - h);
        const __m512 qh = _mm512_maskz_loadu_ps(mask, query + h);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          acc[i] = _mm512_fmadd_ps(qh, _mm512_maskz_loadu_ps(mask, keys + i * h_len + h), acc[i]);
      }
      _mm512_storeu_ps(out + m * s_len + s, Totals(acc));
    }
  }
  for (; s < s_len; ++s) {  // the last s_len % 16 keys one by one
    const float* key = k + s * h_len;
    for (int64_t m = 0; m < m_len; ++m) {
      const float* query = q + m * h_len;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t h = 0; h < h_len; h += 16) {
        const __mmask16 mask = Tail(h_len - h);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, query + h),
                              _mm512_maskz_loadu_ps(mask, key + h), acc);
      }
      out[m * s_len + s] = _mm512_reduce_add_ps(acc);
    }
  }
}

template <int R>
void WeightedTile(const float* w, const float* v, float* out, int64_t s_len, int64_t h_len,
                  int64_t h0) {
  constexpr int kVectors = 4;  // 64 output columns per pass
  __m512 acc[R][kVectors];
  __mmask16 mask[kVectors];
  for (int j = 0; j < kVectors; ++j) mask[j] = Tail(std::max<int64_t>(0, h_len - h0 - 16 * j));
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < s_len; ++s) {
    const float* value = v + s * h_len + h0;
    __m512 row[kVectors];
    for (int j = 0; j < kVectors; ++j) row[j] = _mm512_maskz_loadu_ps(mask[j], value + 16 * j);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * s_len + s]);
      for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_fmadd_ps(b, row[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j)
      _mm512_mask_storeu_ps(out + r * h_len + h0 + 16 * j, mask[j], acc[r][j]);
}

void WeightedSlice(const float* w, const float* v, float* out, int64_t m_len, int64_t s_len,
                   int64_t h_len) {
  for (int64_t h0 = 0; h0 < h_len; h0 += 64) {
    for (int64_t m = 0; m < m_len; m += 4) {
      const float* wm = w + m * s_len;
      float* om = out + m * h_len;
      switch (std::min<int64_t>(4, m_len - m)) {
        case 1: WeightedTile<1>(wm, v, om, s_len, h_len, h0); break;
        case 2: WeightedTile<2>(wm, v, om, s_len, h_len, h0); break;
        case 3: WeightedTile<3>(wm, v, om, s_len, h_len, h0); break;
        default: WeightedTile<4>(wm, v, om, s_len, h_len, h0); break;
      }
    }
  }
}

bool SameSlices(const ffi::Buffer<ffi::F32>& a, const ffi::Buffer<ffi::F32>& b) {
  return a.dimensions().size() == 3 && b.dimensions().size() == 3 &&
         a.dimensions()[0] == b.dimensions()[0];
}

ffi::Error Scores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (!SameSlices(q, k) || qd[2] != kd[2]) {
    return ffi::Error::InvalidArgument("kvlab scores: expects q [P, M, H] and k [P, S, H]");
  }
  const int64_t m_len = qd[1], s_len = kd[1], h_len = kd[2];
  const float *qp = q.typed_data(), *kp = k.typed_data();
  float* op = out->typed_data();
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, s_len * h_len * 4));
  Parallel(pool, qd[0], chunk, [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      ScoresSlice(qp + p * m_len * h_len, kp + p * s_len * h_len, op + p * m_len * s_len, m_len,
                  s_len, h_len);
  });
  return ffi::Error::Success();
}

ffi::Error Weighted(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> v,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions(), vd = v.dimensions();
  if (!SameSlices(w, v) || wd[2] != vd[1]) {
    return ffi::Error::InvalidArgument("kvlab weighted_sum: expects w [P, M, S] and v [P, S, H]");
  }
  const int64_t m_len = wd[1], s_len = vd[1], h_len = vd[2];
  const float *wp = w.typed_data(), *vp = v.typed_data();
  float* op = out->typed_data();
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, s_len * h_len * 4));
  Parallel(pool, wd[0], chunk, [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      WeightedSlice(wp + p * m_len * s_len, vp + p * s_len * h_len, op + p * m_len * h_len, m_len,
                    s_len, h_len);
  });
  return ffi::Error::Success();
}

}  // namespace

#define KVLAB_BINARY_F32                   \
  ffi::Ffi::Bind()                         \
      .Ctx<ffi::ThreadPool>()              \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabScores, Scores, KVLAB_BINARY_F32);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabWeightedSum, Weighted, KVLAB_BINARY_F32);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabPanelMatmul, PanelMatmul, KVLAB_BINARY_F32);
