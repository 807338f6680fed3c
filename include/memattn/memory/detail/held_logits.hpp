#pragma once
// HeldLogits: a softmax memory's own copy of the logit options it was built with
// (SoftmaxOptions, kernels/softmax_options.hpp): the softcap, and for the queries its
// attends take together (1 for attend, the g query heads of a group for attend_group)
// the ALiBi slopes and the learned sink logits. The options change no stored pair, so
// snapshots do not record them (as the paged pool's): a snapshot loads into a memory
// of other options, which then reads the same pairs its own way.

#include "memattn/kernels/decode_attention.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <vector>

namespace memattn::detail {

/// Whether a memory of T over rows stored as S takes FpMath::bf16: float over bfloat16 or
/// FP8 (each of whose values is a bfloat16 one).
template <class T, class S>
inline constexpr bool bf16_products =
    std::is_same_v<T, float> &&
    (std::is_same_v<S, Eigen::bfloat16> || std::is_same_v<S, Fp8E4M3> || std::is_same_v<S, Fp8E5M2>);

/// A softmax memory's copy of its logit options; see the top of the file.
class HeldLogits {
public:
    HeldLogits() = default;

    /// Checks and copies the logit options of `options` for `memory` (its name): the
    /// spans hold one value per query its attends take, the same count for both. The
    /// memory's window and sink tokens are its own (`window_allowed`: SlidingWindowCache
    /// takes them from the options); a memory's queries come after its keys, so
    /// `causal` must be true and no tree is given. T: the scalar the memory computes in,
    /// in which the values must be finite. `bf16_allowed`: the memory stores its rows as
    /// bfloat16 or FP8 and computes in float, so it takes FpMath::bf16 (its attends then round
    /// the queries and the weights to bfloat16: GroupAttention's fold_bf16).
    template <class T>
    HeldLogits(const char* memory, const SoftmaxOptions& options, std::type_identity<T>, bool window_allowed = false,
               bool bf16_allowed = false)
        : softcap_(options.softcap),
          slopes_(options.alibi_slopes.begin(), options.alibi_slopes.end()),
          sinks_(options.sink_logits.begin(), options.sink_logits.end()),
          fpmath_(options.fpmath) {
        const Index heads = static_cast<Index>(std::max(slopes_.size(), sinks_.size()));
        check_logit_options<T>(memory, options, std::max<Index>(heads, 1));
        require(options.causal, memory, "options.causal",
                "is false, but a memory's queries come after its keys (for cross attention, extend() the memory "
                "with the encoder's pairs and attend)");
        require(options.parents.empty(), memory, "options.parents",
                "is given, but a memory attends one token at a time (verify a tree with causal_softmax_attention "
                "or the paged pool)");
        require(options.fpmath == FpMath::strict || bf16_allowed, memory, "options.fpmath",
                "is not FpMath::strict, but this memory reads its pairs as stored and keeps its own products "
                "(FpMath::bf16 is taken by KVCache and SlidingWindowCache of float over rows stored as "
                "Eigen::bfloat16, Fp8E4M3 or Fp8E5M2, and MultiHead over them; round with causal_softmax_attention "
                "or the multi-head kernel)");
        if (!window_allowed) {
            require(options.window == 0, memory, "options.window", "is ", options.window,
                    ", expected 0: a window is SlidingWindowCache's (or this memory's own argument)");
            require(options.sink_tokens == 0, memory, "options.sink_tokens", "is ", options.sink_tokens,
                    ", expected 0: sink tokens are SlidingWindowCache's");
        }
        heads_ = slopes_.empty() && sinks_.empty() ? 0 : heads;
    }

    /// Whether any option is on (else the memory's plain attends run).
    [[nodiscard]] bool any() const noexcept { return softcap_ > 0 || heads_ > 0 || fpmath_ != FpMath::strict; }
    /// Queries per attend the per-query values are for: 0 when there are none.
    [[nodiscard]] Index queries() const noexcept { return heads_; }
    /// Whether ALiBi slopes are given.
    [[nodiscard]] bool alibi() const noexcept { return !slopes_.empty(); }

    /// `base` (the memory's scale, window and sinks) with the logit options, its spans
    /// viewing this copy.
    [[nodiscard]] SoftmaxOptions into(SoftmaxOptions base) const noexcept {
        base.softcap = softcap_;
        base.alibi_slopes = slopes_;
        base.sink_logits = sinks_;
        if (fpmath_ != FpMath::strict)  // a latent cache holds its own (without_fpmath)
            base.fpmath = fpmath_;
        return base;
    }
    /// The options of query m of an attend of queries() queries (its own slope and sink).
    [[nodiscard]] SoftmaxOptions member(SoftmaxOptions base, Index m) const noexcept {
        return heads_ == 0 ? into(base) : head_options(into(base), m);
    }
    /// What GroupAttention does with them for queries at `position`.
    [[nodiscard]] DecodeLogits decode(Index position) const noexcept {
        return DecodeLogits::of(into({}), position);
    }

    /// Throws std::invalid_argument unless an attend of `rows` queries fits the
    /// per-query values (one each, or none given).
    void check_rows(const char* function, const char* argument, Index rows) const {
        require(heads_ == 0 || rows == heads_, function, argument, "has ", rows, " rows, but the memory's "
                "options give ", heads_, heads_ == 1 ? " value" : " values",
                " per attend (options.alibi_slopes, options.sink_logits): one per query it attends with");
    }

private:
    double softcap_ = 0;
    std::vector<double> slopes_, sinks_;
    FpMath fpmath_ = FpMath::strict;
    Index heads_ = 0;
};

}  // namespace memattn::detail
