// nbdebug's optional compiled statistics kernel (see kernels.py): the sum, the sum of
// squares, the min and the max of a dense CPU tensor in one pass over its memory, plus
// the histogram of its evenly strided sample, in one call and one small result. The eager
// path needs three passes (sum, dot, aminmax), five dispatches and a batched histogram
// over all samples of a pass for the same numbers.
//
// Accumulation: float32, float16 and bfloat16 tensors are summed in float32 lanes over
// blocks of BLOCK elements, the block totals in float64; float64 tensors in float64.
// min and max are NaN when the sum is: the tensor holds a NaN (torch.aminmax's answer), or
// both infinities. Either way the tensor is not finite and nbdebug measures it again
// element-wise; a per-element NaN flag would stop the compiler from vectorising the loop.

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t BLOCK = 2048;         // float lanes are flushed to float64 per block
constexpr int64_t TASK = int64_t(1) << 16;  // elements per parallel task

template <typename acc_t>
struct Partial {
  double sum = 0.0;
  double sq = 0.0;
  acc_t lo = std::numeric_limits<acc_t>::infinity();
  acc_t hi = -std::numeric_limits<acc_t>::infinity();
};

template <typename scalar_t, typename acc_t>
Partial<acc_t> reduce_range(const scalar_t* p, int64_t begin, int64_t end) {
  Partial<acc_t> out;
  acc_t lo[LANES], hi[LANES];
  for (int64_t l = 0; l < LANES; ++l) {
    lo[l] = out.lo;
    hi[l] = out.hi;
  }
  int64_t i = begin;
  while (i + LANES <= end) {
    const int64_t stop = std::min(end, i + BLOCK);
    acc_t s[LANES] = {0}, q[LANES] = {0};
    for (; i + LANES <= stop; i += LANES) {
      for (int64_t l = 0; l < LANES; ++l) {
        const acc_t v = static_cast<acc_t>(p[i + l]);
        s[l] += v;
        q[l] += v * v;
        lo[l] = std::min(v, lo[l]);
        hi[l] = std::max(v, hi[l]);
      }
    }
    double bs = 0.0, bq = 0.0;
    for (int64_t l = 0; l < LANES; ++l) {
      bs += s[l];
      bq += q[l];
    }
    out.sum += bs;
    out.sq += bq;
  }
  for (; i < end; ++i) {
    const acc_t v = static_cast<acc_t>(p[i]);
    out.sum += v;
    out.sq += static_cast<double>(v * v);
    lo[0] = std::min(v, lo[0]);
    hi[0] = std::max(v, hi[0]);
  }
  for (int64_t l = 0; l < LANES; ++l) {
    out.lo = std::min(lo[l], out.lo);
    out.hi = std::max(hi[l], out.hi);
  }
  return out;
}

template <typename scalar_t, typename acc_t>
void moments(const scalar_t* p, int64_t n, double underflow, double* o) {
  const int64_t tasks = (n + TASK - 1) / TASK;
  std::vector<Partial<acc_t>> parts(tasks);
  at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      parts[t] = reduce_range<scalar_t, acc_t>(p, t * TASK, std::min(n, (t + 1) * TASK));
    }
  });
  Partial<acc_t> all;
  for (const auto& part : parts) {
    all.sum += part.sum;
    all.sq += part.sq;
    all.lo = std::min(part.lo, all.lo);
    all.hi = std::max(part.hi, all.hi);
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  o[0] = all.sum;
  o[1] = all.sq;
  const bool bad = std::isnan(all.sum);
  o[2] = bad ? nan : static_cast<double>(all.lo);
  o[3] = bad ? nan : static_cast<double>(all.hi);
  // every element below `underflow` in magnitude: its float squares rounded to 0 (or lost
  // their precision); square them again in float64 (rare, so a second pass costs little)
  const double amax = std::max(std::abs(o[2]), std::abs(o[3]));
  if (!bad && amax > 0.0 && amax < underflow) {
    double sq = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(static_cast<acc_t>(p[i]));
      sq += v * v;
    }
    o[1] = sq;
  }
}

// The bins of log10|v| over [lo, hi), clamped at both ends. A float magnitude is binned
// by its exponent and mantissa bits: table[2e] is the bin of the smallest magnitude with
// biased exponent e, and magnitudes whose mantissa bits reach table[2e + 1] fall into the
// next bin (bins are wider than an octave, so an octave holds at most one edge; stats.py
// builds the table from the same bins as the eager histogram). A double takes log10.
struct Bins {
  int64_t n;
  double lo, scale;
  const int32_t* table;
};

inline int64_t bin_of(float a, const Bins& b) {
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  const uint32_t e = bits >> 23, m = bits & 0x7FFFFFu;
  return b.table[2 * e] + (static_cast<int32_t>(m) >= b.table[2 * e + 1] ? 1 : 0);
}

inline int64_t bin_of(double a, const Bins& b) {
  const double k = std::floor((std::log10(a) - b.lo) * b.scale);
  return static_cast<int64_t>(std::min(std::max(k, 0.0), static_cast<double>(b.n - 1)));
}

// The histogram of every step-th of p's first k * step elements, in acc_t, into
// h[0 .. n + 2]: bin counts, then zeros, NaN/Inf and the sample's size.
template <typename scalar_t, typename acc_t>
void histogram(const scalar_t* p, int64_t step, int64_t k, const Bins& b, double* h) {
  std::vector<int64_t> c(b.n + 2, 0);
  for (int64_t j = 0; j < k; ++j) {
    const acc_t a = std::fabs(static_cast<acc_t>(p[j * step]));
    if (a == acc_t(0)) {
      ++c[b.n];
    } else if (!std::isfinite(a)) {
      ++c[b.n + 1];
    } else {
      ++c[bin_of(a, b)];
    }
  }
  for (int64_t i = 0; i < b.n + 2; ++i) h[i] = static_cast<double>(c[i]);
  h[b.n + 2] = static_cast<double>(k);
}

}  // namespace

// One float64 row [sum, sum of squares, min, max, histogram counts (bins), zeros, NaN/Inf,
// sample size] of x. The histogram is of every ceil(n / max_sample)-th element (at most
// max_sample), in float64 for a float64 tensor and float32 otherwise, into `bins` bins of
// log10|v| over [lo, hi) (clamped at both ends); `table` is int32 [256, 2], see Bins. A
// tensor whose largest magnitude is below `underflow` has its squares summed in float64.
// x: a non-empty contiguous CPU tensor of a floating dtype (it may require grad: it is
// only read).
torch::Tensor quick_stats(const torch::Tensor& x, int64_t max_sample, int64_t bins, double lo,
                          double hi, const torch::Tensor& table, double underflow) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.numel() > 0,
              "quick_stats expects a non-empty contiguous CPU tensor");
  TORCH_CHECK(max_sample >= 1, "quick_stats expects max_sample >= 1, got ", max_sample);
  TORCH_CHECK(bins >= 1 && hi > lo, "quick_stats expects bins >= 1 and hi > lo");
  TORCH_CHECK(table.scalar_type() == torch::kInt32 && table.is_contiguous() &&
                  table.numel() == 512,
              "quick_stats expects an int32 [256, 2] bin table");
  const int64_t n = x.numel();
  auto row = torch::empty({4 + bins + 3}, torch::kFloat64);
  double* o = row.data_ptr<double>();
  const int64_t step = n <= max_sample ? 1 : (n + max_sample - 1) / max_sample;
  const int64_t k = (n + step - 1) / step;
  const int32_t* tab = table.const_data_ptr<int32_t>();
  for (int64_t e = 0; e < 256; ++e) {
    TORCH_CHECK(tab[2 * e] >= 0 && tab[2 * e] < bins && (tab[2 * e] + 1 < bins ||
                tab[2 * e + 1] > 0x7FFFFF), "quick_stats: the bin table names a bin out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_stats", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    moments<scalar_t, acc_t>(p, n, underflow, o);
    histogram<scalar_t, acc_t>(p, step, k, {bins, lo, static_cast<double>(bins) / (hi - lo), tab},
                               o + 4);
  });
  return row;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quick_stats", &quick_stats, "sum, sum of squares, min, max and a sample's histogram");
}
