// The C++ kernels behind kernels/cpu_decode_step.py (see its docstring); bound in module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <numeric>
#include <vector>

#include "simd.h"
#include "cpu_ops.h"
#include "cpu_linear.h"
#include "cpu_qlinear.h"
#include "cpu_decode_attention.h"

namespace cpu_decode_step {

// Seconds decode_layers spent in the layers' linear projections, in attention and in the rest
// (RoPE, KV writes, norms, activations), and decode_tokens in its LM head's matmul, summed over
// calls while `on` (`timing` below; off, no clock is read). One engine's steps at a time: the
// totals are not split by caller.
struct StepClock {
  std::atomic<bool> on{false};
  double linear = 0, attention = 0, other = 0, head = 0;
};
inline StepClock step_clock;

// The totals since the last call (then zeroed), and timing turned on or off from now.
inline std::vector<double> timing(bool on) {
  StepClock& c = step_clock;
  std::vector<double> totals{c.linear, c.attention, c.other, c.head};
  c.linear = c.attention = c.other = c.head = 0;
  c.on.store(on);
  return totals;
}

inline double clock_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// x times panel matrices side by side (part j gives sizes[j] output features), the parts'
// outputs concatenated.
static torch::Tensor side_by_side(torch::Tensor x, const std::vector<torch::Tensor>& parts,
                                  const std::vector<int64_t>& sizes) {
  if (parts.size() == 1) return cpu_qlinear::any_linear(x, parts[0], sizes[0]);
  std::vector<torch::Tensor> ys;
  for (size_t j = 0; j < parts.size(); ++j)
    ys.push_back(cpu_qlinear::any_linear(x, parts[j], sizes[j]));
  return torch::cat(ys, 1);
}

// The layers' weights as decode_layers takes them (described below), converted from Python once,
// when the model is built: pybind11 converts every tensor of a call's lists on each call, and a
// step would pass ~250 of them.
struct DecoderWeights {
  std::vector<std::vector<torch::Tensor>> qkv;
  std::vector<std::vector<int64_t>> qkv_sizes;
  std::vector<torch::Tensor> o;
  std::vector<std::vector<torch::Tensor>> gate_up;
  std::vector<std::vector<int64_t>> gate_up_sizes;
  std::vector<torch::Tensor> down, post_norm, next_norm;
};

// The caches, positions and step metadata of decode_layers and decode_tokens.
struct StepArgs {
  const std::vector<torch::Tensor>& k_cache;
  const std::vector<torch::Tensor>& v_cache;
  const std::vector<torch::Tensor>& k_scale;
  const std::vector<torch::Tensor>& v_scale;
  torch::Tensor pos, cos_t, sin_t, slots, tables, lens;
  int64_t heads, kv_heads, head_dim, intermediate;
  double scale, eps;
};

// Every layer of the model for B decode tokens. x [B, H] is the residual stream, updated in
// place; h [B, H] the first layer's input norm of it. Per layer i: the fused QKV (and gate/up)
// weights as one or more panel matrices side by side (blocks of different formats) with their
// output sizes, the O and down weights, each as cpu_linear panels or cpu_qlinear's quantized
// ones, the post-attention norm's weight and the weight of the norm after the MLP (the next
// layer's input norm, the final norm after the last), the layer's K and V caches
// [NB, BS, KVH, D], fp32, or int8 / fp8 with their scales [NB, BS, KVH] (none for fp32).
// Returns the final norm of x. The weights come as one DecoderWeights, built once.
static torch::Tensor layers(torch::Tensor x, torch::Tensor h, const DecoderWeights& w,
                            const StepArgs& a) {
  const auto &k_cache = a.k_cache, &v_cache = a.v_cache, &k_scale = a.k_scale,
             &v_scale = a.v_scale;
  const auto &pos = a.pos, &cos_t = a.cos_t, &sin_t = a.sin_t, &slots = a.slots,
             &tables = a.tables, &lens = a.lens;
  const int64_t heads = a.heads, kv_heads = a.kv_heads, head_dim = a.head_dim,
                intermediate = a.intermediate;
  const double scale = a.scale, eps = a.eps;
  const auto& qkv = w.qkv;
  const auto& qkv_sizes = w.qkv_sizes;
  const auto& o = w.o;
  const auto& gate_up = w.gate_up;
  const auto& gate_up_sizes = w.gate_up_sizes;
  const auto& down = w.down;
  const auto& post_norm = w.post_norm;
  const auto& next_norm = w.next_norm;
  const int64_t B = x.size(0), H = x.size(1), L = static_cast<int64_t>(qkv.size());
  const int64_t rows = heads + 2 * kv_heads;
  TORCH_CHECK(o.size() == qkv.size() && gate_up.size() == qkv.size() &&
                  qkv_sizes.size() == qkv.size() && gate_up_sizes.size() == qkv.size() &&
                  down.size() == qkv.size() && post_norm.size() == qkv.size() &&
                  next_norm.size() == qkv.size() && k_cache.size() == qkv.size() &&
                  v_cache.size() == qkv.size() && k_scale.size() == v_scale.size() &&
                  (k_scale.empty() || k_scale.size() == qkv.size()),
              "decode_layers: one of each per layer (scales: none for an fp32 cache)");
  auto scale_of = [](const std::vector<torch::Tensor>& s, int64_t i) {
    return s.empty() ? std::optional<torch::Tensor>() : std::optional<torch::Tensor>(s[i]);
  };
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(std::accumulate(qkv_sizes[i].begin(), qkv_sizes[i].end(), int64_t{0}) ==
                        rows * head_dim &&
                    std::accumulate(gate_up_sizes[i].begin(), gate_up_sizes[i].end(),
                                    int64_t{0}) == 2 * intermediate &&
                    qkv_sizes[i].size() == qkv[i].size() &&
                    gate_up_sizes[i].size() == gate_up[i].size(),
                "decode_layers: the parts' sizes do not add up to the projections'");
  StepClock& clock = step_clock;
  const bool timed = clock.on.load();
  double last = timed ? clock_now() : 0.0;
  auto lap = [&](double& total) {  // the time since the last lap, added to `total`
    if (!timed) return;
    const double t = clock_now();
    total += t - last;
    last = t;
  };
  for (int64_t i = 0; i < L; ++i) {
    auto t = side_by_side(h, qkv[i], qkv_sizes[i]).view({B, rows, head_dim});
    lap(clock.linear);
    cpu_ops::rope_(t, heads + kv_heads, pos, cos_t, sin_t);
    cpu_ops::store_kv(t.narrow(1, heads, kv_heads), t.narrow(1, heads + kv_heads, kv_heads),
                      k_cache[i], v_cache[i], slots, scale_of(k_scale, i), scale_of(v_scale, i));
    lap(clock.other);
    auto attn = cpu_decode_attention::paged_decode(t.narrow(1, 0, heads).contiguous(),
                                                   k_cache[i], v_cache[i], tables, lens, scale,
                                                   scale_of(k_scale, i), scale_of(v_scale, i));
    lap(clock.attention);
    auto a = cpu_qlinear::any_linear(attn.reshape({B, heads * head_dim}), o[i], H);
    lap(clock.linear);
    h = cpu_ops::add_rms_norm(a, x, post_norm[i], eps);
    lap(clock.other);
    auto gate_up_out = side_by_side(h, gate_up[i], gate_up_sizes[i]);
    lap(clock.linear);
    auto act = cpu_ops::silu_mul(gate_up_out);
    lap(clock.other);
    auto down_out = cpu_qlinear::any_linear(act, down[i], H);
    lap(clock.linear);
    h = cpu_ops::add_rms_norm(down_out, x, next_norm[i], eps);
    lap(clock.other);
  }
  return h;
}

// `layers` as Python calls it.
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor h, const DecoderWeights& w,
                            std::vector<torch::Tensor> k_cache,
                            std::vector<torch::Tensor> v_cache,
                            std::vector<torch::Tensor> k_scale,
                            std::vector<torch::Tensor> v_scale, torch::Tensor pos,
                            torch::Tensor cos_t, torch::Tensor sin_t, torch::Tensor slots,
                            torch::Tensor tables, torch::Tensor lens, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                            double scale, double eps) {
  // The engine runs steps in a thread beside the server's event loop, which must not wait for
  // a whole step. Nothing below touches a Python object.
  pybind11::gil_scoped_release no_gil;
  return layers(x, h, w,
                {k_cache, v_cache, k_scale, v_scale, pos, cos_t, sin_t, slots, tables, lens,
                 heads, kv_heads, head_dim, intermediate, scale, eps});
}

// A model's whole decode step bound once, for decode_tokens: the embedding (an fp32 table
// [V, H], or Q4_1 / Q8_0 rows as cpu_ops::embed_rows takes them: quants, scales and, for Q4_1,
// mins), the first layer's input norm, the layers, the LM head (panels of either kind, `vocab`
// rows), the KV cache's tensors (as decode_layers takes them) and the model's shapes. pybind11
// converts every tensor of a call's lists on each call (~120 for a cache's), so a step's call
// passes its own tensors alone.
struct DecodeModel {
  torch::Tensor embed;
  std::optional<torch::Tensor> embed_d, embed_m;
  torch::Tensor first_norm, head;
  int64_t vocab;
  DecoderWeights layers;
  std::vector<torch::Tensor> k_cache, v_cache, k_scale, v_scale;
  int64_t heads, kv_heads, head_dim, intermediate;
  double scale, eps;
};

// A whole decode step from token ids to logits: the embedding of `ids` (one a row), the first
// input norm, `layers`, and the LM head on `head_threads` threads (each logit is one thread's:
// the same on any count). With `argmax`, each row's argmax and its logprob as well
// (cpu_ops::argmax_logsumexp's, the logprob rounded to fp32 as top - lse is), else two empty
// lists. The same kernels in the same order as LlamaModel.forward, compute_logits and the
// sampler's greedy draw, so the same bits; the GIL released throughout. The step's own
// tensors are decode_layers'.
std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<double>> decode_tokens(
    const DecodeModel& m, std::vector<int64_t> ids, torch::Tensor pos, torch::Tensor cos_t,
    torch::Tensor sin_t, torch::Tensor slots, torch::Tensor tables, torch::Tensor lens,
    int64_t head_threads, bool argmax) {
  pybind11::gil_scoped_release no_gil;
  const auto index = torch::tensor(ids, torch::kLong);
  auto x = m.embed_d ? cpu_ops::embed_rows(m.embed, *m.embed_d, m.embed_m, index)
                     : m.embed.index_select(0, index);
  auto h = cpu_ops::rms_norm(x, m.first_norm, m.eps);
  h = layers(x, h, m.layers,
             {m.k_cache, m.v_cache, m.k_scale, m.v_scale, pos, cos_t, sin_t, slots, tables, lens,
              m.heads, m.kv_heads, m.head_dim, m.intermediate, m.scale, m.eps});
  StepClock& clock = step_clock;
  const bool timed = clock.on.load();
  const double t0 = timed ? clock_now() : 0.0;
  const int before = at::get_num_threads();
  if (head_threads > 0 && head_threads != before) at::set_num_threads(head_threads);
  auto logits = cpu_qlinear::any_linear(h, m.head, m.vocab);
  if (head_threads > 0 && head_threads != before) at::set_num_threads(before);
  if (timed) clock.head += clock_now() - t0;
  std::vector<int64_t> tokens;
  std::vector<double> logprobs;
  if (argmax) {
    const auto drawn = cpu_ops::argmax_logsumexp(logits);
    const int64_t* id = drawn[0].data_ptr<int64_t>();
    const float* lse = drawn[1].data_ptr<float>();
    const float* top = drawn[2].data_ptr<float>();
    for (int64_t r = 0; r < logits.size(0); ++r) {
      tokens.push_back(id[r]);
      logprobs.push_back(static_cast<double>(top[r] - lse[r]));
    }
  }
  return {logits, tokens, logprobs};
}

}  // namespace cpu_decode_step
