// A store load's blocks into their KV-cache blocks in one call (kernels/cpu_ops.py,
// write_frames): the frames' K and V, as stored (their bytes: no tensor is made per frame), go
// into every layer's cache block, either as a copy of their bytes (a frame in the
// cache's own format, int8 / fp8 with its scales) or dequantized into an fp32 cache (code *
// scale, as reference.dequantize_kv). Without the GIL: the loader thread's copies run while
// the event loop receives the next batch. A frame whose checksum the reader left to the copy
// (codec.read_unchecked) is hashed just before its block is written, while its bytes are in
// the core's cache for the copy that follows: the first one that does not verify ends the
// write. write_templated takes whole frames and also makes the reader's comparison with the
// load's template (codec.FrameTemplate) itself, frame by frame, before the checksum.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <array>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_ops.h"

#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

namespace cpu_load {

// int8 codes * their row's scale into fp32 rows of d floats (d a multiple of 8, out 32-byte
// aligned): streaming stores, which write the cache's lines without first reading them in
// (a load's fp32 writes are 4x its int8 bytes, more than the caches hold). True where it ran.
static bool dequantize_int8_streaming(const int8_t* q, const float* scale, float* out,
                                      int64_t rows, int64_t d) {
#ifdef __AVX2__
  if (d % 8 != 0 || reinterpret_cast<uintptr_t>(out) % 32 != 0) return false;
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 s = _mm256_set1_ps(scale[r]);
    for (int64_t i = 0; i < d; i += 8) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + r * d + i));
      const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
      _mm256_stream_ps(out + r * d + i, _mm256_mul_ps(x, s));
    }
  }
  return true;
#else
  (void)q, (void)scale, (void)out, (void)rows, (void)d;
  return false;
#endif
}

template <typename Code, typename Decode>
static void dequantize_block(const Code* q, const float* scale, float* out, int64_t rows,
                             int64_t d, Decode decode) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale[r];
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = decode(q[r * d + i]) * s;
  }
}

static std::vector<uint8_t*> layers(const std::vector<torch::Tensor>& ts, const torch::Tensor& like,
                                    const char* what) {
  std::vector<uint8_t*> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.sizes() == like.sizes() &&
                    t.scalar_type() == like.scalar_type(),
                "write_frames: every layer's ", what, " must be alike and contiguous");
    out.push_back(static_cast<uint8_t*>(t.data_ptr()));
  }
  return out;
}

// xxh3-128 over `head`, the scales' length (8 bytes, little-endian), the scales, then K's and
// V's bytes (the frame's payload), in the canonical (big-endian) byte order: codec's checksum.
static bool checksum_matches(const std::string& head, const uint8_t* scales, int64_t scale_len,
                             const uint8_t* k, const uint8_t* v, int64_t half,
                             const std::string& digest) {
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, head.data(), head.size());
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(scale_len) >> (8 * i));
  XXH3_128bits_update(&state, len, sizeof(len));
  if (scale_len) XXH3_128bits_update(&state, scales, static_cast<size_t>(scale_len));
  XXH3_128bits_update(&state, k, static_cast<size_t>(half));
  XXH3_128bits_update(&state, v, static_cast<size_t>(half));
  XXH128_canonical_t out;
  XXH128_canonicalFromHash(&out, XXH3_128bits_digest(&state));
  return digest.size() == sizeof(out) && std::memcmp(out.digest, digest.data(), sizeof(out)) == 0;
}

// Each frame's byte buffers (`request()` needs the GIL: taken before it is released), every
// one `bytes` long. Python keeps the objects, and so their bytes, alive for the call.
static std::vector<const uint8_t*> buffers(const std::vector<pybind11::buffer>& bs, int64_t bytes,
                                           const char* what) {
  std::vector<const uint8_t*> out;
  out.reserve(bs.size());
  for (const auto& b : bs) {
    const pybind11::buffer_info info = b.request();
    TORCH_CHECK(info.ndim == 1 && info.itemsize == 1 && info.size == bytes &&
                    (info.strides.empty() || info.strides[0] == 1),
                "write_frames: every ", what, " must be ", bytes, " contiguous bytes");
    out.push_back(static_cast<const uint8_t*>(info.ptr));
  }
  return out;
}

// The cache a load writes into: each layer's K and V (and an int8 / fp8 cache's scales), and
// how a block stored as `stored_name` ("int8", "fp8", "float32", "bfloat16" or "float16") goes
// into it: a copy of its bytes (and scales) where that is the cache's own type, else int8 / fp8
// dequantized into an fp32 cache. Checked with the GIL held; `put` runs without it.
struct Target {
  int64_t num_blocks, L, rows, d, block, block_bytes, scale_bytes;
  c10::ScalarType stored;
  bool quantized, copy;
  std::vector<uint8_t*> kc, vc, ksc, vsc;

  Target(const std::string& stored_name, const std::vector<torch::Tensor>& k_cache,
         const std::vector<torch::Tensor>& v_cache, const std::vector<torch::Tensor>& k_scale,
         const std::vector<torch::Tensor>& v_scale) {
    L = static_cast<int64_t>(k_cache.size());
    TORCH_CHECK(L > 0 && static_cast<int64_t>(v_cache.size()) == L,
                "write_frames: one cache tensor per layer");
    const auto& like = k_cache[0];
    TORCH_CHECK(like.dim() == 4, "write_frames: cache layers are [num_blocks, block_size, kvh, d]");
    num_blocks = like.size(0), rows = like.size(1) * like.size(2), d = like.size(3);
    const auto cache = like.scalar_type();
    stored = stored_name == "int8"       ? torch::kChar
             : stored_name == "fp8"      ? torch::kFloat8_e4m3fn
             : stored_name == "float32"  ? torch::kFloat
             : stored_name == "bfloat16" ? torch::kBFloat16
             : stored_name == "float16"  ? torch::kHalf
                                         : torch::kByte;
    TORCH_CHECK(stored != torch::kByte, "write_frames: no stored type ", stored_name);
    quantized = stored == torch::kChar || stored == torch::kFloat8_e4m3fn;
    copy = stored == cache;
    TORCH_CHECK(copy || (quantized && cache == torch::kFloat),
                "write_frames: frames must be in the cache's format, or int8 / fp8 into fp32");
    block = rows * d;
    block_bytes = block * static_cast<int64_t>(c10::elementSize(stored));
    scale_bytes = rows * static_cast<int64_t>(sizeof(float));
    kc = layers(k_cache, like, "K cache"), vc = layers(v_cache, like, "V cache");
    if (quantized && copy) {
      TORCH_CHECK(static_cast<int64_t>(k_scale.size()) == L &&
                      static_cast<int64_t>(v_scale.size()) == L && k_scale[0].dim() == 3 &&
                      k_scale[0].size(0) == num_blocks && k_scale[0].numel() == num_blocks * rows,
                  "write_frames: an int8 / fp8 cache's scales [num_blocks, block_size, kvh]");
      ksc = layers(k_scale, k_scale[0], "K scales");
      vsc = layers(v_scale, k_scale[0], "V scales");
      TORCH_CHECK(k_scale[0].scalar_type() == torch::kFloat, "write_frames: fp32 scales");
    }
  }

  // The bytes of a frame's scales: [2, L, block_size, kvh] fp32 (K's, V's); none for floats.
  int64_t frame_scale_bytes() const { return quantized ? 2 * L * scale_bytes : 0; }

  void check_blocks(const std::vector<int64_t>& dst) const {
    for (int64_t b : dst) TORCH_CHECK(b >= 0 && b < num_blocks, "write_frames: block ", b);
  }

  // Block `at` from K's and V's bytes [L, block_size, kvh, d] as stored (and the scales).
  void put(const uint8_t* k, const uint8_t* v, const uint8_t* scales, int64_t at) const {
    const auto& fp8 = cpu_ops::fp8_values();
    for (int64_t l = 0; l < L; ++l) {
      const uint8_t* src[2] = {k + l * block_bytes, v + l * block_bytes};
      uint8_t* out[2] = {kc[l], vc[l]};
      for (int kv = 0; kv < 2; ++kv) {
        const float* s =
            quantized ? reinterpret_cast<const float*>(scales) + (kv * L + l) * rows : nullptr;
        if (copy) {
          std::memcpy(out[kv] + at * block_bytes, src[kv], block_bytes);
          if (quantized) std::memcpy((kv ? vsc : ksc)[l] + at * scale_bytes, s, scale_bytes);
        } else if (stored == torch::kChar) {
          const auto* codes = reinterpret_cast<const int8_t*>(src[kv]);
          float* rows_out = reinterpret_cast<float*>(out[kv]) + at * block;
          if (!dequantize_int8_streaming(codes, s, rows_out, rows, d))
            dequantize_block(codes, s, rows_out, rows, d,
                             [](int8_t x) { return static_cast<float>(x); });
        } else {
          dequantize_block(src[kv], s, reinterpret_cast<float*>(out[kv]) + at * block, rows, d,
                           [&fp8](uint8_t x) { return fp8[x]; });
        }
      }
    }
  }
};

// k[j], v[j]: block j's K and V [num_layers, block_size, kvh, d] as stored (`stored_name`),
// each a buffer of bytes (a frame's payload halves, or a decoded block's tensors); scales[j]
// (int8 / fp8 only) its fp32 scales [2, num_layers, block_size, kvh] (K's, V's). k_cache /
// v_cache: each layer's [num_blocks, block_size, kvh, d] (k_scale / v_scale their
// [num_blocks, block_size, kvh] for an int8 / fp8 cache); dst[j]: block j's cache block (see
// Target). heads[j] / digests[j] (none, or one per block; an empty digest: block j was verified
// already): block j's checksum, checked before it is written. Returns how many leading blocks
// were written: all of them, or up to the first whose checksum does not verify.
int64_t write_frames(const std::vector<pybind11::buffer>& k, const std::vector<pybind11::buffer>& v,
                     const std::vector<pybind11::buffer>& scales, const std::string& stored_name,
                     const std::vector<torch::Tensor>& k_cache,
                     const std::vector<torch::Tensor>& v_cache,
                     const std::vector<torch::Tensor>& k_scale,
                     const std::vector<torch::Tensor>& v_scale, const std::vector<int64_t>& dst,
                     const std::vector<std::string>& heads,
                     const std::vector<std::string>& digests) {
  const int64_t n = static_cast<int64_t>(dst.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(k.size()) == n && static_cast<int64_t>(v.size()) == n,
              "write_frames: one K and V per block");
  const Target t(stored_name, k_cache, v_cache, k_scale, v_scale);
  const auto kp = buffers(k, t.L * t.block_bytes, "K");
  const auto vp = buffers(v, t.L * t.block_bytes, "V");
  std::vector<const uint8_t*> sp(n, nullptr);
  if (t.quantized) {
    TORCH_CHECK(static_cast<int64_t>(scales.size()) == n, "write_frames: scales per block");
    sp = buffers(scales, t.frame_scale_bytes(), "scales");
  }
  t.check_blocks(dst);
  const bool checked = !digests.empty();
  TORCH_CHECK(!checked || (static_cast<int64_t>(digests.size()) == n &&
                           static_cast<int64_t>(heads.size()) == n),
              "write_frames: a head and a digest per block, or none");

  pybind11::gil_scoped_release no_gil;
  for (int64_t j = 0; j < n; ++j) {
    if (checked && !digests[j].empty() &&
        !checksum_matches(heads[j], sp[j], t.frame_scale_bytes(), kp[j], vp[j],
                          t.L * t.block_bytes, digests[j])) {
      _mm_sfence();
      return j;
    }
    t.put(kp[j], vp[j], sp[j], dst[j]);
  }
  _mm_sfence();  // the streaming stores, ordered before whoever reads the blocks next
  return n;
}

static bool all_finite(const uint8_t* f32, int64_t bytes) {
  for (int64_t i = 0; i + 4 <= bytes; i += 4) {
    uint32_t bits;
    std::memcpy(&bits, f32 + i, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u) return false;  // inf or nan (-ffast-math: no isfinite)
  }
  return true;
}

// Whole frames laid out as one template (codec.FrameTemplate): frame j is heads[j], the
// scales (`scale_len` bytes, finite), `middle`, the payload (`payload_len` bytes: K's then
// V's), `tail` and a 16-byte digest, nothing else (lengths other than the cache's: no frame
// is). Its checksum: xxh3-128 over hashed[j], the scales' length, the scales and the payload
// (as write_frames checks it). Block j goes into dst[j] once its frame is so laid out and its
// checksum verifies. Returns (blocks written, why it stopped): 0 all written, 1 frame
// `written` is not laid out as the template (it is left to whoever reads frames otherwise),
// 2 its checksum does not verify.
std::tuple<int64_t, int64_t> write_templated(
    const std::vector<pybind11::buffer>& frames, const std::vector<std::string>& heads,
    const std::vector<std::string>& hashed, const std::string& middle, const std::string& tail,
    int64_t scale_len, int64_t payload_len, const std::string& stored_name,
    const std::vector<torch::Tensor>& k_cache, const std::vector<torch::Tensor>& v_cache,
    const std::vector<torch::Tensor>& k_scale, const std::vector<torch::Tensor>& v_scale,
    const std::vector<int64_t>& dst) {
  const int64_t n = static_cast<int64_t>(dst.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(frames.size()) == n &&
                  static_cast<int64_t>(heads.size()) == n &&
                  static_cast<int64_t>(hashed.size()) == n,
              "write_templated: a frame, a head and a hashed head per block");
  const Target t(stored_name, k_cache, v_cache, k_scale, v_scale);
  t.check_blocks(dst);
  const int64_t half = t.L * t.block_bytes;
  constexpr int64_t digest_len = 16;
  if (scale_len != t.frame_scale_bytes() || payload_len != 2 * half) return {0, 1};
  std::vector<std::pair<const uint8_t*, int64_t>> fp;
  fp.reserve(n);
  for (const auto& f : frames) {
    const pybind11::buffer_info info = f.request();
    TORCH_CHECK(info.ndim == 1 && info.itemsize == 1 &&
                    (info.strides.empty() || info.strides[0] == 1),
                "write_templated: every frame must be contiguous bytes");
    fp.emplace_back(static_cast<const uint8_t*>(info.ptr), info.size);
  }

  pybind11::gil_scoped_release no_gil;
  for (int64_t j = 0; j < n; ++j) {
    const auto [data, size] = fp[j];
    const auto& head = heads[j];
    const int64_t s = static_cast<int64_t>(head.size());
    const int64_t p = s + scale_len + static_cast<int64_t>(middle.size()), end = p + payload_len;
    const bool laid_out =
        size == end + static_cast<int64_t>(tail.size()) + digest_len &&
        std::memcmp(data, head.data(), s) == 0 &&
        std::memcmp(data + s + scale_len, middle.data(), middle.size()) == 0 &&
        std::memcmp(data + end, tail.data(), tail.size()) == 0 &&
        all_finite(data + s, scale_len);
    if (!laid_out) {
      _mm_sfence();
      return {j, 1};
    }
    const std::string digest(reinterpret_cast<const char*>(data + size - digest_len), digest_len);
    if (!checksum_matches(hashed[j], data + s, scale_len, data + p, data + p + half, half,
                          digest)) {
      _mm_sfence();
      return {j, 2};
    }
    t.put(data + p, data + p + half, t.quantized ? data + s : nullptr, dst[j]);
  }
  _mm_sfence();
  return {n, 0};
}

}  // namespace cpu_load
