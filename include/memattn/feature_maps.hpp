#pragma once
// Feature maps φ for linear attention: softmax's exp(q·k) is replaced by φ(q)·φ(k),
// which factorises, so attention becomes a running state (see
// kernels/linear_attention.hpp). Katharopoulos et al. 2020, "Transformers are RNNs".
//
// A feature map is any copyable type with
//   Index output_dim(Index d) const;                     // d' for inputs of dim d
//   void operator()(ConstMatrixRef<T> X, MatrixRef<T> Y) const;   // Y (n×d') = φ(X) (n×d), row by row
// A user's own map is a small struct, e.g. (φ(x) = (x², 1), a positive map):
//
//   struct SquarePlusOne {
//       memattn::Index output_dim(memattn::Index d) const { return d + 1; }
//       void operator()(memattn::ConstMatrixRef<float> X, memattn::MatrixRef<float> Y) const {
//           Y.leftCols(X.cols()) = X.array().square().matrix();
//           Y.col(X.cols()).setOnes();
//       }
//   };
//
// Row-wise means row i of Y depends on row i of X only: the kernels apply φ to one chunk
// of rows at a time, and a memory to one token.

#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <numbers>
#include <random>
#include <type_traits>
#include <utility>

namespace memattn {

/// F maps rows of dim d to rows of dim F::output_dim(d), in scalar T.
template <class F, class T>
concept FeatureMap = Scalar<T> && std::copy_constructible<F> &&
    requires(const F& f, Index d, ConstMatrixRef<T> X, MatrixRef<T> Y) {
        { f.output_dim(d) } -> std::convertible_to<Index>;
        f(X, Y);
    };

namespace detail {

/// The output of every provided map, after its checks: Y is X.rows() × output_dim, a
/// writable row-major view, and shares no element with X.
template <class DX, class DY>
MatrixRef<typename DX::Scalar> feature_output(const char* function, const Eigen::MatrixBase<DX>& X, DY&& Y,
                                              Index output_dim) {
    static_assert(same_scalar<DX, std::remove_cvref_t<DY>>, "memattn feature maps: X and Y must share one scalar type.");
    const ConstMatrixRef<typename DX::Scalar> x = sequence(X);
    MatrixRef<typename DX::Scalar> y = output(std::forward<DY>(Y));
    require(y.rows() == x.rows() && y.cols() == output_dim, function, "Y", "has shape ", shape(y), ", expected ",
            x.rows(), 'x', output_dim, " for X of shape ", shape(x));
    require_disjoint(function, "Y", y, "X", x);
    return y;
}

}  // namespace detail

/// φ(x) = x. With it linear attention is the plain (unnormalised or sign-indefinite)
/// kernel q·k; normalising is only meaningful for inputs with positive q·k.
struct Identity {
    static constexpr const char* snapshot_name = "Identity";  ///< its name in snapshots
    /// d′ = d.
    [[nodiscard]] Index output_dim(Index d) const noexcept { return d; }
    /// Y (n×d′) = φ(X) (n×d), row by row; Y must not overlap X.
    template <class DX, class DY>
    void operator()(const Eigen::MatrixBase<DX>& X, DY&& Y) const {
        detail::feature_output("Identity", X, std::forward<DY>(Y), X.cols()) = X;
    }
};

namespace detail {

/// e^x for float packets with every x ≤ 0 (Cody–Waite range reduction, Taylor degree 7
/// on |f| ≤ ln2/2, 2^r built in the exponent bits; max relative error ≈ 1 ulp):
///   x = r·ln2 + f,  r = round(x·log2 e) ∈ [−126, 0],  e^x = 2^r · Σ_k f^k/k!.
/// Eigen's generic pexp (any sign, a general ldexp) took ~50 cycles per 8 floats on
/// Zen 1; this one half that, and elu+1 is applied to every query and key.
template <class Packet>
Packet exp_nonpositive(const Packet& x) {
    namespace ei = Eigen::internal;
    using PacketI = typename ei::unpacket_traits<Packet>::integer_packet;
    const Packet magic = ei::pset1<Packet>(12582912.0f);  // 1.5·2^23: adding it rounds to an integer
    const Packet v = ei::pmax(x, ei::pset1<Packet>(-87.0f));  // e^−87 is still a normal float
    const Packet r = ei::psub(ei::pmadd(v, ei::pset1<Packet>(1.44269504088896341f), magic), magic);
    Packet f = ei::pmadd(r, ei::pset1<Packet>(-0.693145751953125f), v);  // ln2 = hi + lo, hi exact in r·hi
    f = ei::pmadd(r, ei::pset1<Packet>(-1.428606765330187045e-06f), f);
    Packet p = ei::pset1<Packet>(1.0f / 5040);
    for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
        p = ei::pmadd(p, f, ei::pset1<Packet>(c));
    const PacketI biased = ei::padd(ei::pcast<Packet, PacketI>(r), ei::pset1<PacketI>(127));
    return ei::pmul(p, ei::preinterpret<Packet>(ei::plogical_shift_left<23>(biased)));
}

/// elu(x) + 1 = max(x, 0) + e^{min(x, 0)}: the same values as the two-branch definition,
/// branch-free, and e^ never overflows. An Eigen functor with a packet path, so the
/// assignment is vectorised (a select() went coefficient by coefficient through libm's
/// expf and took 40% of the chunked kernel's time).
template <class T>
struct EluPlusOneOp {
    T operator()(const T& x) const { return std::max(x, T(0)) + std::exp(std::min(x, T(0))); }
    template <class Packet>
    Packet packetOp(const Packet& x) const {
        namespace ei = Eigen::internal;
        const Packet zero = ei::pzero(x);
        if constexpr (std::is_same_v<T, float>)
            return ei::padd(ei::pmax(x, zero), exp_nonpositive(ei::pmin(x, zero)));
        else
            return ei::padd(ei::pmax(x, zero), ei::pexp(ei::pmin(x, zero)));
    }
};

}  // namespace detail

/// φ(x) = elu(x) + 1 = (x + 1 if x > 0, else e^x), positive everywhere; the default.
/// Katharopoulos et al. 2020.
struct EluPlusOne {
    static constexpr const char* snapshot_name = "EluPlusOne";  ///< its name in snapshots
    /// d′ = d.
    [[nodiscard]] Index output_dim(Index d) const noexcept { return d; }
    /// Y (n×d′) = φ(X) (n×d), row by row; Y must not overlap X.
    template <class DX, class DY>
    void operator()(const Eigen::MatrixBase<DX>& X, DY&& Y) const {
        using T = typename DX::Scalar;
        detail::feature_output("EluPlusOne", X, std::forward<DY>(Y), X.cols()) = X.unaryExpr(detail::EluPlusOneOp<T>{});
    }
};

/// φ(x) = max(x, 0). Non-negative; rows of zeros give zero weight.
struct Relu {
    static constexpr const char* snapshot_name = "Relu";  ///< its name in snapshots
    /// d′ = d.
    [[nodiscard]] Index output_dim(Index d) const noexcept { return d; }
    /// Y (n×d′) = φ(X) (n×d), row by row; Y must not overlap X.
    template <class DX, class DY>
    void operator()(const Eigen::MatrixBase<DX>& X, DY&& Y) const {
        using T = typename DX::Scalar;
        detail::feature_output("Relu", X, std::forward<DY>(Y), X.cols()) = X.array().max(T(0)).matrix();
    }
};

/// Second-order Taylor features of exp (as in Based, Arora et al. 2024):
/// φ(x) = (1, x, (w_ij x_i x_j)_{i≤j}) with w_ii = 1/√2, w_ij = 1 (i < j), so that
///   φ(q)·φ(k) = 1 + q·k + Σ_i q_i²k_i²/2 + Σ_{i<j} q_iq_jk_ik_j = 1 + q·k + (q·k)²/2,
/// which is > 0 for every q·k (the quadratic has no real root). d' = 1 + d + d(d+1)/2.
struct Taylor2 {
    static constexpr const char* snapshot_name = "Taylor2";  ///< its name in snapshots
    /// d′ = 1 + d + d(d+1)/2.
    [[nodiscard]] Index output_dim(Index d) const noexcept { return 1 + d + d * (d + 1) / 2; }
    /// Y (n×d′) = φ(X) (n×d), row by row; Y must not overlap X.
    template <class DX, class DY>
    void operator()(const Eigen::MatrixBase<DX>& X, DY&& Y) const {
        using T = typename DX::Scalar;
        auto y = detail::feature_output("Taylor2", X, std::forward<DY>(Y), output_dim(X.cols()));
        const Index d = X.cols();
        const T diagonal = T(1) / std::numbers::sqrt2_v<T>;
        for (Index r = 0; r < X.rows(); ++r) {
            const auto x = X.row(r);
            y(r, 0) = T(1);
            y.row(r).segment(1, d) = x;
            Index k = 1 + d;
            for (Index i = 0; i < d; ++i) {  // the upper triangle of x ⊗ x, row i: x_i · x_{i..d-1}
                y.row(r).segment(k, d - i) = x(i) * x.tail(d - i);
                y(r, k) *= diagonal;
                k += d - i;
            }
        }
    }
};

/// Performer's positive random features (FAVOR+, Choromanski et al. 2021, "Rethinking
/// Attention with Performers"), an unbiased estimate of the softmax kernel:
///   x̃ = x / d^{1/4},   φ_i(x) = exp(ω_i·x̃ − |x̃|²/2 − s(x)) / √m,   i < m,
///   E[φ(q)·φ(k)] = exp(q·k/√d)   (for s = 0),
/// with ω_i drawn in orthogonal blocks of d (Gram–Schmidt of a Gaussian d×d matrix,
/// each row rescaled to the norm of an independent Gaussian vector), which lowers the
/// variance against i.i.d. draws.
///
/// Max-shift: s(x) = max(0, max_i (ω_i·x̃ − |x̃|²/2) − L) with headroom
/// L = log(max T)/4 (≈ 22 for float, ≈ 177 for double). For every ordinary input the
/// largest exponent is below L, s = 0 and the estimate is unbiased (and large enough
/// against LinearOptions::eps). Only a row whose kernel values would exceed e^L is
/// shifted down so that its features stay ≤ e^L/√m and products and sums over long
/// sequences stay finite; for a query this cancels exactly in normalised attention,
/// for a key it lowers that key's weight (Performer shifts keys by one global maximum,
/// which a map applied chunk by chunk or token by token cannot know).
///
/// Reproducible: ω comes from std::mt19937_64 (output fixed by the standard) through a
/// Box–Muller transform written out here (std::normal_distribution's output is not
/// fixed), computed in double and then cast, so one seed gives the same features on
/// every platform (up to the last ulp of the C library's log/cos/sin).
class FavorPlus {
public:
    static constexpr const char* snapshot_name = "FavorPlus";  ///< its name in snapshots
    /// m features for inputs of dim d, drawn from `seed`.
    FavorPlus(Index d, Index m, std::uint64_t seed) : d_(d), m_(m) {
        detail::require(d > 0, "FavorPlus", "d", "is ", d, ", expected > 0");
        detail::require(m > 0, "FavorPlus", "m", "is ", m, ", expected > 0");
        omega_ = draw(d, m, seed);
        const double input_scale = 1.0 / std::sqrt(std::sqrt(static_cast<double>(d)));  // x̃ = x / d^{1/4}
        scaled_double_ = omega_ * input_scale;
        scaled_float_ = scaled_double_.cast<float>();
    }

    /// m; throws unless d is the dim the features were drawn for.
    [[nodiscard]] Index output_dim(Index d) const {
        detail::require(d == d_, "FavorPlus::output_dim", "d", "is ", d, ", expected ", d_,
                        " (the input dim the random features were drawn for)");
        return m_;
    }
    /// d, the input dim the features were drawn for.
    [[nodiscard]] Index input_dim() const noexcept { return d_; }
    /// m, the number of random features (the output dim).
    [[nodiscard]] Index features() const noexcept { return m_; }
    /// The random directions ω (m×d, before the 1/d^{1/4} input scaling), in double.
    [[nodiscard]] const Matrix<double>& projection() const noexcept { return omega_; }

    /// Y (n×m) = φ(X) (n×d), row by row, each row max-shifted if it must be; Y must not overlap X.
    template <class DX, class DY>
    void operator()(const Eigen::MatrixBase<DX>& X, DY&& Y) const {
        using T = typename DX::Scalar;
        static_assert(Scalar<T>, "memattn::FavorPlus works on float or double rows.");
        detail::require(X.cols() == d_, "FavorPlus", "X", "has shape ", detail::shape(X), ", expected ", d_,
                        " columns (the input dim the random features were drawn for)");
        auto y = detail::feature_output("FavorPlus", X, std::forward<DY>(Y), m_);
        const auto& w = scaled<T>();
        y.noalias() = X * w.transpose();  // ω_i·x̃ for every row and feature
        const T half_norm = T(0.5) / std::sqrt(static_cast<T>(d_));  // |x̃|²/2 = |x|² / (2√d)
        const T headroom = std::log(std::numeric_limits<T>::max()) / T(4);
        const T normaliser = T(1) / std::sqrt(static_cast<T>(m_));
        for (Index r = 0; r < y.rows(); ++r) {
            auto row = y.row(r).array();
            row -= half_norm * X.row(r).squaredNorm();
            const T shift = std::max(T(0), row.maxCoeff() - headroom);
            row = (row - shift).exp() * normaliser;
        }
    }

private:
    template <class T>
    const Matrix<T>& scaled() const noexcept {
        if constexpr (std::is_same_v<T, float>)
            return scaled_float_;
        else
            return scaled_double_;
    }

    /// Standard normal draws: Box–Muller on two uniforms from mt19937_64,
    /// u1 ∈ (0, 1], u2 ∈ [0, 1):  z0 = √(−2 ln u1) cos 2πu2,  z1 = √(−2 ln u1) sin 2πu2.
    class Normal {
    public:
        explicit Normal(std::uint64_t seed) : gen_(seed) {}
        double operator()() {
            if (has_spare_) {
                has_spare_ = false;
                return spare_;
            }
            const double u1 = (static_cast<double>(gen_() >> 11) + 1.0) * 0x1.0p-53;
            const double u2 = static_cast<double>(gen_() >> 11) * 0x1.0p-53;
            const double radius = std::sqrt(-2.0 * std::log(u1));
            const double angle = 2.0 * std::numbers::pi * u2;
            spare_ = radius * std::sin(angle);
            has_spare_ = true;
            return radius * std::cos(angle);
        }

    private:
        std::mt19937_64 gen_;
        double spare_ = 0;
        bool has_spare_ = false;
    };

    /// m rows of orthogonal blocks: per block a d×d Gaussian matrix, orthonormalised
    /// row by row (modified Gram–Schmidt), each row then scaled to the norm of a fresh
    /// Gaussian d-vector so that the rows are marginally N(0, I_d).
    static Matrix<double> draw(Index d, Index m, std::uint64_t seed) {
        Normal normal(seed);
        Matrix<double> omega(m, d), block(d, d);
        for (Index first = 0; first < m; first += d) {
            for (Index i = 0; i < block.size(); ++i)
                block.data()[i] = normal();
            for (Index i = 0; i < d; ++i) {
                for (Index j = 0; j < i; ++j)
                    block.row(i) -= block.row(i).dot(block.row(j)) * block.row(j);
                block.row(i) /= block.row(i).norm();  // a Gaussian matrix has full rank almost surely
            }
            const Index rows = std::min(d, m - first);
            for (Index i = 0; i < rows; ++i) {
                double chi2 = 0;
                for (Index k = 0; k < d; ++k) {
                    const double z = normal();
                    chi2 += z * z;
                }
                omega.row(first + i) = std::sqrt(chi2) * block.row(i);
            }
        }
        return omega;
    }

    Index d_;
    Index m_;
    Matrix<double> omega_;
    Matrix<double> scaled_double_;
    Matrix<float> scaled_float_;
};

}  // namespace memattn

// An Eigen specialisation for a detail type: not in the API reference.
/// \cond
/// The packet path of EluPlusOne wherever Eigen vectorises exp for T.
template <class T>
struct Eigen::internal::functor_traits<memattn::detail::EluPlusOneOp<T>> {
    enum {
        Cost = 24 * NumTraits<T>::MulCost,
        PacketAccess = packet_traits<T>::HasExp && packet_traits<T>::HasMin && packet_traits<T>::HasMax
    };
};
/// \endcond
