// nbdebug's optional compiled statistics kernel (see kernels.py): the sum, the sum of
// squares, the min and the max of a dense CPU tensor in one pass over its memory, plus
// the evenly strided histogram sample, in one call. The eager path needs three passes
// (sum, dot, aminmax) and five dispatches for the same numbers.
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
void moments(const scalar_t* p, int64_t n, double* o) {
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
}

}  // namespace

// (stats, sample): stats is float64 [sum, sum of squares, min, max]; sample holds every
// ceil(n / max_sample)-th element (at most max_sample), float64 for a float64 tensor and
// float32 otherwise. x: a non-empty contiguous CPU tensor of a floating dtype.
std::tuple<torch::Tensor, torch::Tensor> quick_stats(const torch::Tensor& x, int64_t max_sample) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.numel() > 0,
              "quick_stats expects a non-empty contiguous CPU tensor");
  TORCH_CHECK(max_sample >= 1, "quick_stats expects max_sample >= 1, got ", max_sample);
  const int64_t n = x.numel();
  auto stats = torch::empty({4}, torch::kFloat64);
  const int64_t step = n <= max_sample ? 1 : (n + max_sample - 1) / max_sample;
  const int64_t k = (n + step - 1) / step;
  const bool wide = x.scalar_type() == torch::kFloat64;
  auto sample = torch::empty({k}, wide ? torch::kFloat64 : torch::kFloat32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_stats", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    moments<scalar_t, acc_t>(p, n, stats.data_ptr<double>());
    acc_t* s = sample.data_ptr<acc_t>();
    for (int64_t j = 0; j < k; ++j) s[j] = static_cast<acc_t>(p[j * step]);
  });
  return {stats, sample};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quick_stats", &quick_stats, "sum, sum of squares, min, max and a strided sample");
}
