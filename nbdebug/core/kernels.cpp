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


// The parallel work of many tensors: each tensor of TASK elements or more is split into
// pieces of TASK elements, each its own task; smaller tensors (biases, LayerNorm weights)
// are packed together into shared tasks of about TASK elements. A task is a range of
// pieces; each piece has its own partial, combined per tensor afterwards.
struct Piece {
  int64_t tensor, begin, end;
};

struct Work {
  std::vector<Piece> pieces;
  std::vector<int64_t> task_start;  // first piece of each task, then pieces.size()
};

Work plan(const std::vector<torch::Tensor>& xs) {
  Work w;
  int64_t open = 0;  // elements in the current shared task
  for (int64_t i = 0; i < static_cast<int64_t>(xs.size()); ++i) {
    const int64_t n = xs[i].numel();
    if (n == 0) continue;
    if (n >= TASK) {
      for (int64_t b = 0; b < n; b += TASK) {
        w.task_start.push_back(static_cast<int64_t>(w.pieces.size()));
        w.pieces.push_back({i, b, std::min(n, b + TASK)});
      }
      open = TASK;  // the next small tensor starts a new task
      continue;
    }
    if (open == 0 || open + n > TASK) {
      w.task_start.push_back(static_cast<int64_t>(w.pieces.size()));
      open = 0;
    }
    w.pieces.push_back({i, 0, n});
    open += n;
  }
  w.task_start.push_back(static_cast<int64_t>(w.pieces.size()));
  return w;
}

// The partial of one piece in double (float32 lanes for narrower floats, unless wide).
Partial<double> reduce_piece(const torch::Tensor& x, int64_t b, int64_t e, bool wide) {
  Partial<double> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "reduce_piece", [&] {
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    if (wide || std::is_same_v<scalar_t, double>) {
      out = reduce_range<scalar_t, double>(p, b, e);
    } else {
      const auto part = reduce_range<scalar_t, float>(p, b, e);
      out = {part.sum, part.sq, static_cast<double>(part.lo), static_cast<double>(part.hi)};
    }
  });
  return out;
}

// [sum, sum of squares, min, max] of every tensor into rows first_row.. of out (row stride
// `width`), the pieces of all tensors spread over torch's intra-op threads. min and max
// are NaN where the sum is, and for an empty tensor.
void moments_rows(const std::vector<torch::Tensor>& xs, double* out, int64_t width, bool wide) {
  const Work w = plan(xs);
  std::vector<Partial<double>> parts(w.pieces.size());
  const int64_t tasks = static_cast<int64_t>(w.task_start.size()) - 1;
  at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t j = w.task_start[t]; j < w.task_start[t + 1]; ++j) {
        const Piece& pc = w.pieces[j];
        parts[j] = reduce_piece(xs[pc.tensor], pc.begin, pc.end, wide);
      }
    }
  });
  std::vector<Partial<double>> all(xs.size());
  for (size_t j = 0; j < w.pieces.size(); ++j) {
    Partial<double>& a = all[w.pieces[j].tensor];
    a.sum += parts[j].sum;
    a.sq += parts[j].sq;
    a.lo = std::min(parts[j].lo, a.lo);
    a.hi = std::max(parts[j].hi, a.hi);
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (size_t i = 0; i < xs.size(); ++i) {
    double* o = out + static_cast<int64_t>(i) * width;
    const bool bad = std::isnan(all[i].sum) || xs[i].numel() == 0;
    o[0] = all[i].sum;
    o[1] = all[i].sq;
    o[2] = bad ? nan : all[i].lo;
    o[3] = bad ? nan : all[i].hi;
  }
}

// The tail of a quick row after its moments: the float64 sum of squares of a tensor whose
// every element is below `underflow` in magnitude (its float squares rounded to 0 or lost
// their precision; rare, so a second pass costs little), then the sample's histogram.
void finish_row(const torch::Tensor& x, int64_t max_sample, const Bins& bins, double underflow,
                double* o) {
  const int64_t n = x.numel();
  const int64_t step = n <= max_sample ? 1 : (n + max_sample - 1) / max_sample;
  const int64_t k = (n + step - 1) / step;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "finish_row", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    const double amax = std::max(std::abs(o[2]), std::abs(o[3]));
    if (!std::isnan(o[0]) && amax > 0.0 && amax < underflow) {
      double sq = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const double v = static_cast<double>(static_cast<acc_t>(p[i]));
        sq += v * v;
      }
      o[1] = sq;
    }
    histogram<scalar_t, acc_t>(p, step, k, bins, o + 4);
  });
}

void check_tensors(const std::vector<torch::Tensor>& xs, const char* who) {
  for (const auto& x : xs) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && at::isFloatingType(x.scalar_type()),
                who, " expects contiguous CPU tensors of a floating dtype, got one of ",
                x.scalar_type(), x.is_contiguous() ? "" : " (not contiguous)", " on ",
                x.device());
  }
}

double* rows_of(const torch::Tensor& out, int64_t first_row, int64_t n, int64_t width,
                const char* who) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kFloat64 &&
                  out.is_contiguous() && out.dim() == 2 && out.size(1) == width,
              who, " expects a contiguous CPU float64 out of ", width, " columns");
  TORCH_CHECK(first_row >= 0 && first_row + n <= out.size(0), who, " expects rows ", first_row,
              "..", first_row + n - 1, " inside out's ", out.size(0), " rows");
  return out.data_ptr<double>() + first_row * width;
}

Bins bins_of(int64_t max_sample, int64_t bins, double lo, double hi, const torch::Tensor& table) {
  TORCH_CHECK(max_sample >= 1, "quick_stats expects max_sample >= 1, got ", max_sample);
  TORCH_CHECK(bins >= 1 && hi > lo, "quick_stats expects bins >= 1 and hi > lo");
  TORCH_CHECK(table.scalar_type() == torch::kInt32 && table.is_contiguous() &&
                  table.numel() == 512,
              "quick_stats expects an int32 [256, 2] bin table");
  const int32_t* tab = table.const_data_ptr<int32_t>();
  for (int64_t e = 0; e < 256; ++e) {
    TORCH_CHECK(tab[2 * e] >= 0 && tab[2 * e] < bins && (tab[2 * e] + 1 < bins ||
                tab[2 * e + 1] > 0x7FFFFF), "quick_stats: the bin table names a bin out of range");
  }
  return {bins, lo, static_cast<double>(bins) / (hi - lo), tab};
}

}  // namespace

// The quick rows of many tensors, written into rows first_row.. of the preallocated
// float64 `out` (4 + bins + 3 columns): per tensor [sum, sum of squares, min, max,
// histogram counts (bins), zeros, NaN/Inf, sample size]. The histogram is of every
// ceil(n / max_sample)-th element (at most max_sample), in float64 for a float64 tensor
// and float32 otherwise, into `bins` bins of log10|v| over [lo, hi) (clamped at both
// ends); `table` is int32 [256, 2], see Bins. A tensor whose largest magnitude is below
// `underflow` has its squares summed in float64. xs: contiguous CPU tensors of floating
// dtypes (they may require grad: they are only read; an empty one gives min and max NaN
// and a sample of size 0). One call for all: large tensors split across torch's intra-op
// threads, small ones packed into shared tasks.
void quick_stats_into(const std::vector<torch::Tensor>& xs, const torch::Tensor& out,
                      int64_t first_row, int64_t max_sample, int64_t bins, double lo, double hi,
                      const torch::Tensor& table, double underflow) {
  const Bins b = bins_of(max_sample, bins, lo, hi, table);
  check_tensors(xs, "quick_stats_into");
  const int64_t width = 4 + bins + 3;
  const int64_t n = static_cast<int64_t>(xs.size());
  double* o = rows_of(out, first_row, n, width, "quick_stats_into");
  moments_rows(xs, o, width, false);
  // histograms: a task per 16 tensors (at most 16 x max_sample sampled elements)
  at::parallel_for(0, n, 16, [&](int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i) finish_row(xs[i], max_sample, b, underflow, o + i * width);
  });
}

// quick_stats_into for one non-empty tensor (what the per-event hooks call: no vector of
// tensors, no new row).
void quick_stats_row(const torch::Tensor& x, const torch::Tensor& out, int64_t row,
                     int64_t max_sample, int64_t bins, double lo, double hi,
                     const torch::Tensor& table, double underflow) {
  const Bins b = bins_of(max_sample, bins, lo, hi, table);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.numel() > 0,
              "quick_stats expects a non-empty contiguous CPU tensor");
  double* o = rows_of(out, row, 1, 4 + bins + 3, "quick_stats_row");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_stats", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    moments<scalar_t, acc_t>(x.const_data_ptr<scalar_t>(), x.numel(), underflow, o);
  });
  const int64_t n = x.numel();
  const int64_t step = n <= max_sample ? 1 : (n + max_sample - 1) / max_sample;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_stats", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    histogram<scalar_t, acc_t>(x.const_data_ptr<scalar_t>(), step, (n + step - 1) / step, b,
                               o + 4);
  });
}

// One new float64 row of quick_stats_row (for tests and one-off use).
torch::Tensor quick_stats(const torch::Tensor& x, int64_t max_sample, int64_t bins, double lo,
                          double hi, const torch::Tensor& table, double underflow) {
  auto row = torch::empty({1, 4 + bins + 3}, torch::kFloat64);
  quick_stats_row(x, row, 0, max_sample, bins, lo, hi, table, underflow);
  return row[0];
}

// A new float64 [len(xs), 4] of [sum, sum of squares, min, max] per tensor, in one call
// (the norms of the guard and the per-layer signals). Squares are accumulated in float32
// lanes for float32 and narrower tensors (flushed to float64 per block) unless `wide`,
// in float64 otherwise. xs: contiguous CPU tensors of floating dtypes, empty ones too.
torch::Tensor moments_many(const std::vector<torch::Tensor>& xs, bool wide) {
  check_tensors(xs, "moments_many");
  auto out = torch::empty({static_cast<int64_t>(xs.size()), 4}, torch::kFloat64);
  moments_rows(xs, out.data_ptr<double>(), 4, wide);
  return out;
}

namespace {

// The float64 sum of squares of a[begin, end) (COPY: copied into dst on the way), or of
// a - b, in acc_t lanes flushed to float64 per block.
template <typename scalar_t, typename acc_t, bool COPY>
double pair_sq_range(const scalar_t* a, const scalar_t* b, scalar_t* dst, int64_t begin,
                     int64_t end) {
  double out = 0.0;
  int64_t i = begin;
  auto term = [&](int64_t j) -> acc_t {
    if constexpr (COPY) {
      const scalar_t s = a[j];
      dst[j] = s;
      return static_cast<acc_t>(s);
    } else {
      return static_cast<acc_t>(a[j]) - static_cast<acc_t>(b[j]);
    }
  };
  while (i + LANES <= end) {
    const int64_t stop = std::min(end, i + BLOCK);
    acc_t q[LANES] = {0};
    for (; i + LANES <= stop; i += LANES) {
      for (int64_t l = 0; l < LANES; ++l) {
        const acc_t v = term(i + l);
        q[l] += v * v;
      }
    }
    double bq = 0.0;
    for (int64_t l = 0; l < LANES; ++l) bq += q[l];
    out += bq;
  }
  for (; i < end; ++i) {
    const double v = static_cast<double>(term(i));
    out += v * v;
  }
  return out;
}

// Per pair (a[i], b[i]) of equal shape and dtype, the float64 sum of squares of a[i] - b[i]
// (COPY: of b[i], copied into a[i]), the pieces of all pairs over torch's intra-op threads.
template <bool COPY>
torch::Tensor pair_sq_many(const std::vector<torch::Tensor>& as,
                           const std::vector<torch::Tensor>& bs, bool wide, const char* who) {
  TORCH_CHECK(as.size() == bs.size(), who, " expects two lists of the same length, got ",
              as.size(), " and ", bs.size());
  check_tensors(as, who);
  check_tensors(bs, who);
  for (size_t i = 0; i < as.size(); ++i) {
    TORCH_CHECK(as[i].sizes() == bs[i].sizes() && as[i].scalar_type() == bs[i].scalar_type(),
                who, " expects pairs of one shape and dtype, got ", as[i].sizes(), " ",
                as[i].scalar_type(), " and ", bs[i].sizes(), " ", bs[i].scalar_type());
  }
  const Work w = plan(as);
  std::vector<double> parts(w.pieces.size(), 0.0);
  const int64_t tasks = static_cast<int64_t>(w.task_start.size()) - 1;
  at::parallel_for(0, tasks, 1, [&](int64_t s, int64_t e) {
    for (int64_t t = s; t < e; ++t) {
      for (int64_t j = w.task_start[t]; j < w.task_start[t + 1]; ++j) {
        const Piece& pc = w.pieces[j];
        const torch::Tensor& a = as[pc.tensor];
        const torch::Tensor& b = bs[pc.tensor];
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "pair_sq_many", [&] {
          scalar_t* dst = COPY ? a.data_ptr<scalar_t>() : nullptr;
          const scalar_t* src = COPY ? b.const_data_ptr<scalar_t>() : a.const_data_ptr<scalar_t>();
          const scalar_t* other = COPY ? nullptr : b.const_data_ptr<scalar_t>();
          if (wide || std::is_same_v<scalar_t, double>) {
            parts[j] = pair_sq_range<scalar_t, double, COPY>(src, other, dst, pc.begin, pc.end);
          } else {
            parts[j] = pair_sq_range<scalar_t, float, COPY>(src, other, dst, pc.begin, pc.end);
          }
        });
      }
    }
  });
  auto out = torch::zeros({static_cast<int64_t>(as.size())}, torch::kFloat64);
  double* o = out.data_ptr<double>();
  for (size_t j = 0; j < w.pieces.size(); ++j) o[w.pieces[j].tensor] += parts[j];
  return out;
}

}  // namespace

// A new float64 [len(as)] of the sum of squares of as[i] - bs[i] (the update of a weight
// against its copy), reading both once and writing nothing.
torch::Tensor diff_sq_many(const std::vector<torch::Tensor>& as,
                           const std::vector<torch::Tensor>& bs, bool wide) {
  return pair_sq_many<false>(as, bs, wide, "diff_sq_many");
}

// Copy srcs[i] into dsts[i] and return a new float64 [len(srcs)] of the sum of squares of
// each srcs[i], in one pass over each.
torch::Tensor copy_sq_many(const std::vector<torch::Tensor>& dsts,
                           const std::vector<torch::Tensor>& srcs, bool wide) {
  return pair_sq_many<true>(dsts, srcs, wide, "copy_sq_many");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quick_stats", &quick_stats, "sum, sum of squares, min, max and a sample's histogram");
  m.def("quick_stats_row", &quick_stats_row, "quick_stats into one row of a float64 buffer");
  m.def("quick_stats_into", &quick_stats_into, "quick_stats of many tensors into buffer rows");
  m.def("moments_many", &moments_many, "sum, sum of squares, min and max of many tensors");
  m.def("diff_sq_many", &diff_sq_many, "sum of squares of a - b for many pairs");
  m.def("copy_sq_many", &copy_sq_many, "copy many tensors and return their sums of squares");
}
