// The AVX-512F intrinsics kernels.cc uses, for CPUs with AVX2, FMA and F16C alone
// (AMD's before Zen 4, Intel's before Skylake-X): kernels.cc includes this file when it
// is built without -mavx512f (kvlab/kernels/native/ffi.py picks the flags by the CPU).
//
// A 512-bit vector is a pair of 256-bit ones (lanes 0-7, then 8-15) and a 16-bit mask
// an integer, as AVX-512 has them; each function computes what the AVX-512 intrinsic
// of its name computes (Intel's intrinsics guide), lane for lane. Masked loads and
// stores are AVX2's, which touch no memory in the lanes masked off. A sum over lanes
// adds lanes i and i + 8, then the 8 in kernels.cc's Totals8 order (Total8), so a
// product summed alone (the last keys of a row) rounds as one summed in a block does;
// the AVX-512 build sums in another order, equal within float32 rounding. The lane
// permutations are written out lane by lane (the quantized kernels' unpacking:
// correct, slower than AVX-512's single instruction). Names are macros over kv512_*
// functions, defined after <immintrin.h>, whose own AVX-512 declarations they shadow.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace kv512 {

struct F {  // __m512
  __m256 lo, hi;
};
struct I {  // __m512i
  __m256i lo, hi;
};
struct D {  // __m512d
  __m256d lo, hi;
};
using Mask = uint16_t;  // __mmask16

// Lanes of a 256-bit half as all-ones where bit `shift + lane` of `mask` is set.
inline __m256i Lanes(Mask mask, int shift) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_and_si256(_mm256_set1_epi32((mask >> shift) & 0xFF), bits);
  return _mm256_cmpeq_epi32(set, bits);
}
inline Mask Bits(__m256i lo, __m256i hi) {  // the sign bits of 16 lanes as a mask
  return static_cast<Mask>(_mm256_movemask_ps(_mm256_castsi256_ps(lo)) |
                           (_mm256_movemask_ps(_mm256_castsi256_ps(hi)) << 8));
}

inline F setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F set1_ps(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu_ps(float* p, F a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F add_ps(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F sub_ps(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F mul_ps(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F fmadd_ps(F a, F b, F c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F maskz_loadu_ps(Mask k, const void* p) {
  const float* f = static_cast<const float*>(p);
  if (k == 0xFFFF) return loadu_ps(f);
  return {_mm256_maskload_ps(f, Lanes(k, 0)), _mm256_maskload_ps(f + 8, Lanes(k, 8))};
}
inline void mask_storeu_ps(void* p, Mask k, F a) {
  float* f = static_cast<float*>(p);
  if (k == 0xFFFF) return storeu_ps(f, a);
  _mm256_maskstore_ps(f, Lanes(k, 0), a.lo);
  _mm256_maskstore_ps(f + 8, Lanes(k, 8), a.hi);
}
inline F mask_max_ps(F src, Mask k, F a, F b) {
  return {_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), _mm256_castsi256_ps(Lanes(k, 0))),
          _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), _mm256_castsi256_ps(Lanes(k, 8)))};
}
inline F mask_blend_ps(Mask k, F a, F b) {  // b where k is set
  return {_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(Lanes(k, 0))),
          _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(Lanes(k, 8)))};
}
// The sum of 8 lanes as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): the order of
// kernels.cc's Totals8, so a sum reduced alone equals the same sum reduced among others.
inline float Total8(__m256 v) {
  const __m256 pairs = _mm256_hadd_ps(v, v);
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}
inline float reduce_add_ps(F a) { return Total8(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max_ps(F a) {
  const __m256 x = _mm256_max_ps(a.hi, a.lo);
  __m128 y = _mm_max_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  y = _mm_max_ps(y, _mm_shuffle_ps(y, y, _MM_SHUFFLE(1, 0, 3, 2)));
  y = _mm_max_ps(y, _mm_shuffle_ps(y, y, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtss_f32(y);
}
inline F cvtepi32_ps(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline F cvtph_ps(__m256i raw) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(raw)),
          _mm256_cvtph_ps(_mm256_extracti128_si256(raw, 1))};
}
inline I castps_si512(F a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
inline F castsi512_ps(I a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }

inline I setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I set1_epi32(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I setr_epi32(int32_t a0, int32_t a1, int32_t a2, int32_t a3, int32_t a4, int32_t a5,
                    int32_t a6, int32_t a7, int32_t a8, int32_t a9, int32_t a10, int32_t a11,
                    int32_t a12, int32_t a13, int32_t a14, int32_t a15) {
  return {_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7),
          _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15)};
}
inline I loadu_si512(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
inline I load_si512(const void* p) { return loadu_si512(p); }
inline I maskz_loadu_epi32(Mask k, const void* p) {
  const int* i = static_cast<const int*>(p);
  if (k == 0xFFFF) return loadu_si512(p);
  return {_mm256_maskload_epi32(i, Lanes(k, 0)), _mm256_maskload_epi32(i + 8, Lanes(k, 8))};
}
inline void mask_storeu_epi32(void* p, Mask k, I a) {
  int* i = static_cast<int*>(p);
  _mm256_maskstore_epi32(i, Lanes(k, 0), a.lo);
  _mm256_maskstore_epi32(i + 8, Lanes(k, 8), a.hi);
}
// PACK[m]: byte i is the lane of the i-th set bit of the 8-bit mask m (0 past them).
struct PackTable {
  uint64_t lanes[256];
  constexpr PackTable() : lanes() {
    for (int m = 0; m < 256; ++m) {
      int at = 0;
      for (int lane = 0; lane < 8; ++lane)
        if (m >> lane & 1) lanes[m] |= static_cast<uint64_t>(lane) << (8 * at++);
    }
  }
};
inline constexpr PackTable PACK{};
// The lanes of a half that `bits` sets, packed in order into its first lanes.
inline __m256i Packed(unsigned bits, __m256i half) {
  return _mm256_permutevar8x32_epi32(half,
                                     _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(PACK.lanes[bits])));
}
// Set lanes, packed, in order: a permutation and a masked store per half, no branch on
// the mask (a loop over the lanes mispredicted random masks: ~40 ns a call).
inline void mask_compressstoreu_epi32(void* p, Mask k, I a) {
  const unsigned lo = k & 0xFF, hi = k >> 8;
  const auto first = [](int n) { return Lanes(static_cast<Mask>((1u << n) - 1), 0); };
  int32_t* out = static_cast<int32_t*>(p);
  _mm256_maskstore_epi32(out, first(__builtin_popcount(lo)), Packed(lo, a.lo));
  out += __builtin_popcount(lo);
  _mm256_maskstore_epi32(out, first(__builtin_popcount(hi)), Packed(hi, a.hi));
}
// The same where the 16 ints from p may be written: each half stored whole, the ints past
// its set lanes left for the next store to overwrite (a masked store is microcoded on
// AMD's Zen: the call took as long as the lane loop). Not an AVX-512 intrinsic.
inline void CompressStoreRoom(int32_t* p, Mask k, I a) {
  const unsigned lo = k & 0xFF, hi = k >> 8;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), Packed(lo, a.lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + __builtin_popcount(lo)), Packed(hi, a.hi));
}
#define KV512_INT_OP(name, op)                                \
  inline I name(I a, I b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
KV512_INT_OP(add_epi32, _mm256_add_epi32)
KV512_INT_OP(sub_epi32, _mm256_sub_epi32)
KV512_INT_OP(mullo_epi32, _mm256_mullo_epi32)
KV512_INT_OP(and_si512, _mm256_and_si256)
KV512_INT_OP(or_si512, _mm256_or_si256)
KV512_INT_OP(xor_si512, _mm256_xor_si256)
KV512_INT_OP(srlv_epi32, _mm256_srlv_epi32)
#undef KV512_INT_OP
inline I slli_epi32(I a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline I srli_epi32(I a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline I srai_epi32(I a, int n) { return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)}; }
inline I blend(Mask k, I a, I b) {  // b where k is set
  return {_mm256_blendv_epi8(a.lo, b.lo, Lanes(k, 0)), _mm256_blendv_epi8(a.hi, b.hi, Lanes(k, 8))};
}
inline I mask_add_epi32(I src, Mask k, I a, I b) { return blend(k, src, add_epi32(a, b)); }
inline I mask_sub_epi32(I src, Mask k, I a, I b) { return blend(k, src, sub_epi32(a, b)); }
inline I mask_mov_epi32(I src, Mask k, I a) { return blend(k, src, a); }
inline Mask cmpeq_epi32_mask(I a, I b) {
  return Bits(_mm256_cmpeq_epi32(a.lo, b.lo), _mm256_cmpeq_epi32(a.hi, b.hi));
}
inline Mask cmplt_epi32_mask(I a, I b) {
  return Bits(_mm256_cmpgt_epi32(b.lo, a.lo), _mm256_cmpgt_epi32(b.hi, a.hi));
}
inline Mask cmpge_epi32_mask(I a, I b) { return static_cast<Mask>(~cmplt_epi32_mask(a, b)); }
inline Mask mask_cmpeq_epi32_mask(Mask k, I a, I b) { return k & cmpeq_epi32_mask(a, b); }
inline Mask mask_cmpge_epu32_mask(Mask k, I a, I b) {  // unsigned a >= b: max(a, b) == a
  return k & Bits(_mm256_cmpeq_epi32(_mm256_max_epu32(a.lo, b.lo), a.lo),
                  _mm256_cmpeq_epi32(_mm256_max_epu32(a.hi, b.hi), a.hi));
}
inline int32_t reduce_max_epi32(I a) {
  const __m256i x = _mm256_max_epi32(a.hi, a.lo);
  __m128i y = _mm_max_epi32(_mm256_extracti128_si256(x, 1), _mm256_castsi256_si128(x));
  y = _mm_max_epi32(y, _mm_shuffle_epi32(y, _MM_SHUFFLE(1, 0, 3, 2)));
  y = _mm_max_epi32(y, _mm_shuffle_epi32(y, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtsi128_si32(y);
}
inline I cvtepu8_epi32(__m128i bytes) {
  return {_mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))};
}
inline I cvtepu16_epi32(__m256i halves) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(halves)),
          _mm256_cvtepu16_epi32(_mm256_extracti128_si256(halves, 1))};
}
inline I castsi256_si512(__m256i a) { return {a, _mm256_setzero_si256()}; }
inline __m256i castsi512_si256(I a) { return a.lo; }
inline __m256i extracti64x4_epi64(I a, int half) { return half ? a.hi : a.lo; }
inline I inserti64x4(I a, __m256i b, int half) {
  if (half) a.hi = b;
  else a.lo = b;
  return a;
}

// Lane permutations, one lane at a time: r[i] = the (idx[i] mod 16)-th lane of a, or the
// (idx[i] mod 32)-th of a then b.
template <typename V, typename T>
inline void Store(T* to, V a) {
  if constexpr (sizeof(T) == 4 && std::is_same_v<V, F>) {
    _mm256_storeu_ps(reinterpret_cast<float*>(to), a.lo);
    _mm256_storeu_ps(reinterpret_cast<float*>(to) + 8, a.hi);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), a.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to) + 1, a.hi);
  }
}
template <typename V, typename T>
inline V Permuted(const T* from, I idx, int wrap) {
  alignas(32) int32_t index[16];
  alignas(32) T out[16];
  Store(index, idx);
  for (int lane = 0; lane < 16; ++lane) out[lane] = from[index[lane] & (wrap - 1)];
  if constexpr (std::is_same_v<V, F>) return loadu_ps(reinterpret_cast<const float*>(out));
  else return loadu_si512(out);
}
inline F permutexvar_ps(I idx, F a) {
  alignas(32) float lanes[16];
  Store(lanes, a);
  return Permuted<F>(lanes, idx, 16);
}
inline I permutexvar_epi32(I idx, I a) {
  alignas(32) int32_t lanes[16];
  Store(lanes, a);
  return Permuted<I>(lanes, idx, 16);
}
inline F permutex2var_ps(F a, I idx, F b) {
  alignas(32) float lanes[32];
  Store(lanes, a);
  Store(lanes + 16, b);
  return Permuted<F>(lanes, idx, 32);
}
inline I permutex2var_epi32(I a, I idx, I b) {
  alignas(32) int32_t lanes[32];
  Store(lanes, a);
  Store(lanes + 16, b);
  return Permuted<I>(lanes, idx, 32);
}

inline D set1_pd(double x) { return {_mm256_set1_pd(x), _mm256_set1_pd(x)}; }
inline D mul_pd(D a, D b) { return {_mm256_mul_pd(a.lo, b.lo), _mm256_mul_pd(a.hi, b.hi)}; }
inline D cvtepi32_pd(__m256i a) {
  return {_mm256_cvtepi32_pd(_mm256_castsi256_si128(a)),
          _mm256_cvtepi32_pd(_mm256_extracti128_si256(a, 1))};
}
template <int kMode>
inline D roundscale_pd(D a) {  // to whole numbers (AVX-512's scale 0): round_pd's modes
  static_assert(kMode >> 4 == 0, "avx2.h rounds to whole numbers only");
  return {_mm256_round_pd(a.lo, kMode), _mm256_round_pd(a.hi, kMode)};
}
inline __m256i cvttpd_epi32(D a) {
  return _mm256_set_m128i(_mm256_cvttpd_epi32(a.hi), _mm256_cvttpd_epi32(a.lo));
}

}  // namespace kv512

#define __m512 kv512::F
#define __m512i kv512::I
#define __m512d kv512::D
#define __mmask16 kv512::Mask
#define _mm512_setzero_ps kv512::setzero_ps
#define _mm512_set1_ps kv512::set1_ps
#define _mm512_loadu_ps kv512::loadu_ps
#define _mm512_storeu_ps kv512::storeu_ps
#define _mm512_add_ps kv512::add_ps
#define _mm512_sub_ps kv512::sub_ps
#define _mm512_mul_ps kv512::mul_ps
#define _mm512_fmadd_ps kv512::fmadd_ps
#define _mm512_maskz_loadu_ps kv512::maskz_loadu_ps
#define _mm512_mask_storeu_ps kv512::mask_storeu_ps
#define _mm512_mask_max_ps kv512::mask_max_ps
#define _mm512_mask_blend_ps kv512::mask_blend_ps
#define _mm512_reduce_add_ps kv512::reduce_add_ps
#define _mm512_reduce_max_ps kv512::reduce_max_ps
#define _mm512_cvtepi32_ps kv512::cvtepi32_ps
#define _mm512_cvtph_ps kv512::cvtph_ps
#define _mm512_castps_si512 kv512::castps_si512
#define _mm512_castsi512_ps kv512::castsi512_ps
#define _mm512_setzero_si512 kv512::setzero_si512
#define _mm512_set1_epi32 kv512::set1_epi32
#define _mm512_setr_epi32 kv512::setr_epi32
#define _mm512_loadu_si512 kv512::loadu_si512
#define _mm512_load_si512 kv512::load_si512
#define _mm512_maskz_loadu_epi32 kv512::maskz_loadu_epi32
#define _mm512_mask_storeu_epi32 kv512::mask_storeu_epi32
#define _mm512_mask_compressstoreu_epi32 kv512::mask_compressstoreu_epi32
#define _mm512_add_epi32 kv512::add_epi32
#define _mm512_sub_epi32 kv512::sub_epi32
#define _mm512_mullo_epi32 kv512::mullo_epi32
#define _mm512_and_si512 kv512::and_si512
#define _mm512_or_si512 kv512::or_si512
#define _mm512_xor_si512 kv512::xor_si512
#define _mm512_srlv_epi32 kv512::srlv_epi32
#define _mm512_slli_epi32 kv512::slli_epi32
#define _mm512_srli_epi32 kv512::srli_epi32
#define _mm512_srai_epi32 kv512::srai_epi32
#define _mm512_mask_add_epi32 kv512::mask_add_epi32
#define _mm512_mask_sub_epi32 kv512::mask_sub_epi32
#define _mm512_mask_mov_epi32 kv512::mask_mov_epi32
#define _mm512_cmpeq_epi32_mask kv512::cmpeq_epi32_mask
#define _mm512_cmplt_epi32_mask kv512::cmplt_epi32_mask
#define _mm512_cmpge_epi32_mask kv512::cmpge_epi32_mask
#define _mm512_mask_cmpeq_epi32_mask kv512::mask_cmpeq_epi32_mask
#define _mm512_mask_cmpge_epu32_mask kv512::mask_cmpge_epu32_mask
#define _mm512_reduce_max_epi32 kv512::reduce_max_epi32
#define _mm512_cvtepu8_epi32 kv512::cvtepu8_epi32
#define _mm512_cvtepu16_epi32 kv512::cvtepu16_epi32
#define _mm512_castsi256_si512 kv512::castsi256_si512
#define _mm512_castsi512_si256 kv512::castsi512_si256
#define _mm512_extracti64x4_epi64 kv512::extracti64x4_epi64
#define _mm512_inserti64x4 kv512::inserti64x4
#define _mm512_permutexvar_ps kv512::permutexvar_ps
#define _mm512_permutexvar_epi32 kv512::permutexvar_epi32
#define _mm512_permutex2var_ps kv512::permutex2var_ps
#define _mm512_permutex2var_epi32 kv512::permutex2var_epi32
#define _mm512_set1_pd kv512::set1_pd
#define _mm512_mul_pd kv512::mul_pd
#define _mm512_cvtepi32_pd kv512::cvtepi32_pd
#define _mm512_roundscale_pd(a, mode) kv512::roundscale_pd<(mode)>(a)
#define _mm512_cvttpd_epi32 kv512::cvttpd_epi32
