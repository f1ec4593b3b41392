// y[M, N] = x[M, K] @ W for float32 decode on AVX-512 CPUs, with W stored as
// 32-column panels P[N / 32, K, 32] (P[b, k, j] = W[k, 32 b + j]): each panel is
// one contiguous stream, read once per call whatever M is.
//
// For each panel and each block of up to 8 rows, an 8 x 32 tile of outputs stays
// in 16 zmm registers while k runs over the panel (one broadcast and two FMAs per
// row and k), so small M costs what reading W costs, without the packing a
// general matrix product does on every call. Sums run in k order, one FMA each.
// Panels are split into chunks of about kChunkBytes on XLA's intra-op thread
// pool; the calling thread works too, and a matrix of one chunk never leaves it.
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvlabPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
