// Native float vectors for the kernels' inner loops, in GCC/Clang vector extensions: VW lanes,
// 16 (one AVX-512 register) or 8 (one AVX2 register). A wider type than the machine's registers
// would be split into pairs that the compiler spills to the stack in register-blocked loops, so
// the kernels size their register blocks in these vectors. Loads and stores are unaligned.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline __attribute__((always_inline)) vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline __attribute__((always_inline)) void storev(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}
// VW fp16 values widened to floats (exact).
static inline __attribute__((always_inline)) vf load_half(const uint8_t* p) {
#if VW == 16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// One row of a tile's N accumulator vectors into y: whole vectors when all N * VW columns are
// valid, else the first `cols`.
template <int N>
static inline __attribute__((always_inline)) void store_row(float* y, const vf (&acc)[N],
                                                            int64_t cols) {
  if (cols == N * VW) {
    for (int v = 0; v < N; ++v) storev(y + v * VW, acc[v]);
  } else {
    for (int64_t c = 0; c < cols; ++c) y[c] = acc[c / VW][c % VW];
  }
}

// f.template operator()<R>() for R = rows (1 <= rows <= MAX): a tile's height as a template
// argument, so that each height gets its own register-blocked code.
template <int MAX, class F>
static inline void with_rows(int64_t rows, F&& f) {
  if constexpr (MAX > 0) {
    if (rows == MAX) return f.template operator()<MAX>();
    with_rows<MAX - 1>(rows, f);
  }
}

static inline __attribute__((always_inline)) vf lanes() {  // {0, 1, ..., VW - 1}
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = static_cast<float>(i);
  return v;
}
static inline __attribute__((always_inline)) float hsum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
#if VW == 16
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const v8 a = v;
#endif
  const v4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// VW dot products' partial sums (a[i] holds dot i's lanes) -> one vector of the VW sums, lane i
// = dot i: log2(VW) rounds of pairwise shuffles and adds (a transpose-reduce).
static inline __attribute__((always_inline)) vf reducev(vf* a) {
#if VW == 16
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(a[0], a[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(a[0], a[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
#else
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(a[0], a[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a[0], a[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// a * b + c rounded once: an explicit FMA, which -ffast-math cannot reassociate, so that loops
// whose trip counts the compiler does or does not know compute the same bits.
static inline __attribute__((always_inline)) vf fmadd(vf a, vf b, vf c) {
#if VW == 16
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return a > b ? a : b; }

// Each lane rounded to the nearest integer, ties to even (exact, whatever -ffast-math does).
static inline __attribute__((always_inline)) vf round_even(vf x) {
#if VW == 16
  return (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return (vf)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}

// VW int32 lanes, each within int8's range, as VW bytes.
static inline __attribute__((always_inline)) void store_bytes(int8_t* p, vi v) {
#if VW == 16
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8((__m512i)v));
#else
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128((__m256i)v),
                                    _mm256_extracti128_si256((__m256i)v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
#endif
}

static inline __attribute__((always_inline)) float hmax(vf v) {
#if VW == 16
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
#else
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
#endif
  return std::max(v[0], v[1]);
}

// e^x for x <= 0 (softmax weights), 0 below -87: x = n ln2 + r with n = trunc(x log2 e), so
// r in (-ln2, 0]; e^r by its Taylor series to degree 8 (relative error < 2e-7); then 2^n
// written into the exponent.
static inline __attribute__((always_inline)) vf vexp_neg(vf x) {
  const vf xc = x < -87.f ? vf{} - 87.f : x;
  const vi n = __builtin_convertvector(xc * 1.44269504f, vi);
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = (xc - nf * 0.693145752f) - nf * 1.42860677e-6f;
  vf p = r * (1.f / 40320) + 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vf scale;
  const vi bits = (n + 127) << 23;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? vf{} : p * scale;
}
