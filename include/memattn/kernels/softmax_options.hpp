#pragma once
// SoftmaxOptions: what every softmax entry point takes beside its tensors (the kernels,
// the softmax memories, the paged pool), and their checks (docs/design.md, §4.1). A
// header of its own, so that a caller who only names the options does not compile the
// tiled kernel.
//
// The logit of query i (position p_i) and key j, in the order the options apply
// (ONNX Runtime's and llama.cpp's order: scale, softcap, then the biases):
//
//   s_ij = scale · q_i·k_j
//   s_ij ← c · tanh(s_ij / c)                    softcap = c > 0 (Gemma 2)
//   s_ij ← s_ij − slope_h · |p_i − j|            alibi_slopes[h] (ALiBi; causal: p_i − j ≥ 0)
//   key j visible iff (causal: j ≤ p_i) and (j < sink_tokens or window = 0 or |p_i − j| < window)
//   o_i = Σ_j e^{s_ij} v_j / (e^{σ_h} + Σ_j e^{s_ij})   sink_logits[h] = σ_h (gpt-oss), else no e^{σ_h}
//
// A dense bias or mask (causal_softmax_attention's bias argument) restricts the visible
// keys further, after ALiBi: −∞ masks a key. A tree (parents) places its new tokens at
// their depths' positions, which the window, the sinks and ALiBi then count, and hides
// from each the new tokens that are not its ancestors.
//
// Per-head values (sink_logits, alibi_slopes) are spans the caller keeps alive through
// the call: one value for a single-head call, q_heads for a multi-head one.

#include "memattn/types.hpp"

#include <cmath>
#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>

namespace memattn {

/// The arithmetic of the prefill kernels' two products (Q·Kᵀ and P·V) on float inputs,
/// as oneDNN's fpmath_mode (docs/design.md §4.7c).
enum class FpMath {
    strict,  ///< float products (the default)
    /// Q, K and V rounded to bfloat16 (nearest even) for the products, which then run as
    /// on bfloat16 inputs (AMX tiles or vdpbf16ps where the CPU has them, float products
    /// on the rounded values elsewhere); the softmax, its sums and O stay float.
    bf16,
};

/// Options of the softmax attention calls (docs/design.md, §4.1); see the top of the file.
struct SoftmaxOptions {
    double scale = 0;    ///< multiplies q·k before the softmax; 0 means 1/sqrt(d)
    Index window = 0;    ///< each query sees the keys less than `window` positions away (itself included); 0: no limit
    Index sink_tokens = 0;  ///< the first `sink_tokens` tokens stay visible to every later query (StreamingLLM)
    double softcap = 0;  ///< c > 0: s ← c·tanh(s/c) before the softmax (Gemma 2); 0: off
    bool causal = true;  ///< false: every key, before and after the query (encoders, cross attention)
    std::span<const double> sink_logits = {};   ///< σ_h per query head: joins the denominator with no value (gpt-oss)
    std::span<const double> alibi_slopes = {};  ///< slope_h per query head: s ← s − slope_h·|p_i − j| (ALiBi)
    /// A tree of new tokens (speculative decoding's verify step): for each query, the
    /// index of its parent among the queries (the last Nq keys), or −1; each sees the
    /// keys before them and its ancestors among them, itself included. New token i sits at
    /// position Nk − Nq + depth_i (its ancestors' count), where decoding its path token by
    /// token puts it: the window, the sinks and ALiBi count those positions. Empty: none.
    std::span<const Index> parents = {};
    /// The products' arithmetic on float inputs of causal_softmax_attention and
    /// multi_head_causal_softmax_attention (a single-head call rounds copies of Q, K and V; the
    /// multi-head kernel each KV head once per thread and each item's queries); 16-bit
    /// inputs keep their own. KVCache, SlidingWindowCache, PagedKVCache and LatentKVCache
    /// of float over bfloat16 or FP8 rows (and MultiHead and the model cache over them)
    /// take FpMath::bf16 for their steps and prompts on the rows as stored; the other
    /// memories, ring attention and double inputs refuse anything but FpMath::strict
    /// (docs/design.md §4.7c).
    FpMath fpmath = FpMath::strict;
};

namespace detail {

/// The options' own checks, for a call over `heads` query heads (1 for a single head)
/// that computes in T: values finite as T (a sink logit of 1e300 is a finite double and
/// an infinite float, docs/design.md §3), a softcap ≥ 0, and spans of one value per head
/// or none.
template <class T>
void check_logit_options(std::string_view function, const SoftmaxOptions& options, Index heads) {
    require(options.window >= 0, function, "options.window", "is ", options.window, ", expected >= 0 (0: no limit)");
    require(options.sink_tokens >= 0, function, "options.sink_tokens", "is ", options.sink_tokens, ", expected >= 0");
    require(finite_in<T>(options.softcap) && options.softcap >= 0, function, "options.softcap", "is ",
            options.softcap, ", expected a number >= 0 finite as ", scalar_name<T>, " (0: off)");
    const auto per_head = [&](std::span<const double> values, const char* name, bool allow_minus_inf) {
        if (values.empty())
            return;
        require(static_cast<Index>(values.size()) == heads, function, name, "has ", values.size(),
                " values, expected ", heads, heads == 1 ? " (a single head)" : " (one per query head)");
        for (std::size_t h = 0; h < values.size(); ++h)
            require(finite_in<T>(values[h]) || (allow_minus_inf && values[h] < 0 && std::isinf(values[h])),
                    function, name, "has ", values[h], " for head ", h, ", expected a number finite as ",
                    scalar_name<T>, allow_minus_inf ? " or −∞ (no sink)" : "");
    };
    require(options.fpmath == FpMath::strict || options.fpmath == FpMath::bf16, function, "options.fpmath", "is ",
            static_cast<int>(options.fpmath), ", expected FpMath::strict or FpMath::bf16");
    require(options.fpmath == FpMath::strict || !std::is_same_v<T, double>, function, "options.fpmath",
            "is FpMath::bf16, which rounds float inputs; these compute in double");
    per_head(options.sink_logits, "options.sink_logits", true);
    per_head(options.alibi_slopes, "options.alibi_slopes", false);
    if (options.parents.empty())
        return;
    for (std::size_t i = 0; i < options.parents.size(); ++i)
        require(options.parents[i] >= -1 && options.parents[i] < static_cast<Index>(i), function, "options.parents",
                "has ", options.parents[i], " at ", i, ", expected -1 (a root) or an earlier query, 0 to ",
                static_cast<Index>(i) - 1);
    require(options.causal, function, "options.parents", "is given with options.causal = false: a tree is causal");
}

/// The options of query head h of a multi-head call: its own sink logit and slope.
inline SoftmaxOptions head_options(const SoftmaxOptions& options, Index h) {
    SoftmaxOptions one = options;
    if (!options.sink_logits.empty())
        one.sink_logits = options.sink_logits.subspan(static_cast<std::size_t>(h), 1);
    if (!options.alibi_slopes.empty())
        one.alibi_slopes = options.alibi_slopes.subspan(static_cast<std::size_t>(h), 1);
    return one;
}

}  // namespace detail

}  // namespace memattn
