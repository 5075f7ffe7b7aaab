// eplb_graph::local_expert_pairs' two passes around the layer's kernel, in C++.
//
// The op (custom_ops/local_experts.py) runs a layer's experts on exactly the (token, k) pairs
// routed to this rank's slots: it compacts those pairs into rows of top-1 work, hands them to
// the layer's own kernel (vLLM's, reached from Python), and sums each token's rows back. Done
// with torch ops, the compaction and the sum are about fifteen eager ops and three extra passes
// over [T, H] per layer and call; here each is one call with one pass
// (benchmarks/bench_local_pairs.py measures the op against the kernel alone). Semantics are the
// torch composite's in local_experts.py, bit for bit: the tests hold one to the other.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// Rows per parallel chunk: a row is H elements, so a few rows already amortize a task.
constexpr int64_t kRowGrain = 16;

void check_compact_args(const at::Tensor& hidden_states, const at::Tensor& topk_weights,
                        const at::Tensor& topk_ids, const at::Tensor& expert_map) {
  TORCH_CHECK(topk_ids.dim() == 2 && (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "topk_ids must be [T, K] int32 or int64");
  TORCH_CHECK(hidden_states.dim() == 2 && hidden_states.size(0) == topk_ids.size(0),
              "hidden_states must be [T, H] with T = ", topk_ids.size(0), " (topk_ids' rows)");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must match topk_ids");
  TORCH_CHECK(expert_map.dim() == 1 && (expert_map.scalar_type() == at::kInt || expert_map.scalar_type() == at::kLong),
              "expert_map must be [num_physical] int32/int64");
  TORCH_CHECK(hidden_states.device().is_cpu() && topk_weights.device().is_cpu() && topk_ids.device().is_cpu() &&
                  expert_map.device().is_cpu(),
              "local pairs are compacted on CPU only");
}

// [T * K] physical ids -> each pair's local slot, or -1 (held elsewhere, or an id out of range).
template <typename Id, typename Slot>
std::vector<int64_t> local_slots(const at::Tensor& topk_ids, const at::Tensor& expert_map) {
  const Id* ids = topk_ids.const_data_ptr<Id>();
  const Slot* map = expert_map.const_data_ptr<Slot>();
  const int64_t pairs = topk_ids.numel(), num_physical = expert_map.numel();
  std::vector<int64_t> slots(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t id = static_cast<int64_t>(ids[p]);
    slots[p] = (id >= 0 && id < num_physical) ? static_cast<int64_t>(map[id]) : -1;
  }
  return slots;
}

// (rows [P, H], row_weights [P, 1], row_ids [P, 1], row_tokens [P] int64): the local pairs,
// token-major, as the composite's nonzero orders them; rows keep hidden_states' dtype, weights
// topk_weights', ids topk_ids'.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> local_pairs_compact(
    const at::Tensor& hidden_states, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
    const at::Tensor& expert_map) {
  check_compact_args(hidden_states, topk_weights, topk_ids, expert_map);
  const at::Tensor ids = topk_ids.contiguous(), map = expert_map.contiguous();
  std::vector<int64_t> slots;
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "local_pairs_compact ids", [&] {
    using Id = index_t;
    AT_DISPATCH_INDEX_TYPES(map.scalar_type(), "local_pairs_compact map", [&] {
      slots = local_slots<Id, index_t>(ids, map);
    });
  });
  const int64_t top_k = ids.size(1), width = hidden_states.size(1);
  std::vector<int64_t> pairs;  // flat (token * K + k) of each local pair, in order
  for (int64_t p = 0; p < static_cast<int64_t>(slots.size()); ++p) {
    if (slots[p] >= 0) {
      pairs.push_back(p);
    }
  }
  const int64_t count = static_cast<int64_t>(pairs.size());
  at::Tensor rows = at::empty({count, width}, hidden_states.options());
  at::Tensor row_weights = at::empty({count, 1}, topk_weights.options());
  at::Tensor row_ids = at::empty({count, 1}, ids.options());
  at::Tensor row_tokens = at::empty({count}, ids.options().dtype(at::kLong));
  int64_t* tokens = row_tokens.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    tokens[r] = pairs[r] / top_k;
  }
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "local_pairs_compact row ids", [&] {
    index_t* out = row_ids.mutable_data_ptr<index_t>();
    for (int64_t r = 0; r < count; ++r) {
      out[r] = static_cast<index_t>(slots[pairs[r]]);
    }
  });
  // weights and rows are gathered with index_select's own kernels (any dtype, any strides)
  const at::Tensor flat_pairs = at::from_blob(pairs.data(), {count}, at::kLong);
  row_weights.view({count}).copy_(topk_weights.reshape({-1}).index_select(0, flat_pairs));
  at::index_select_out(rows, hidden_states, 0, row_tokens);
  return {rows, row_weights, row_ids, row_tokens};
}

// Each token's rows summed in float32 in row order and rounded once to rows' dtype; a token
// without rows is zeros. [T, H], contiguous.
template <typename Scalar>
void combine_rows(const Scalar* rows, const int64_t* row_tokens, int64_t count, int64_t width, Scalar* out,
                  int64_t tokens) {
  std::vector<int64_t> first(tokens + 1, count);  // first[t]: t's first row (rows are token-major)
  for (int64_t r = count - 1; r >= 0; --r) {
    first[row_tokens[r]] = r;
  }
  for (int64_t t = tokens - 1; t >= 0; --t) {
    first[t] = std::min(first[t], first[t + 1]);
  }
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(width);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t r = first[t]; r < first[t + 1]; ++r) {
        const Scalar* row = rows + r * width;
        for (int64_t h = 0; h < width; ++h) {
          sum[h] += static_cast<float>(row[h]);
        }
      }
      Scalar* target = out + t * width;
      for (int64_t h = 0; h < width; ++h) {
        target[h] = static_cast<Scalar>(sum[h]);
      }
    }
  });
}

at::Tensor local_pairs_combine(const at::Tensor& rows, const at::Tensor& row_tokens, int64_t tokens) {
  TORCH_CHECK(rows.dim() == 2 && rows.device().is_cpu(), "rows must be [P, H] on CPU");
  TORCH_CHECK(row_tokens.dim() == 1 && row_tokens.size(0) == rows.size(0) && row_tokens.scalar_type() == at::kLong,
              "row_tokens must be [P] int64, P = ", rows.size(0));
  TORCH_CHECK(tokens >= 0, "tokens must be >= 0");
  const at::Tensor source = rows.contiguous(), owners = row_tokens.contiguous();
  const int64_t* owner = owners.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < owners.numel(); ++r) {  // token-major and in range, or refused
    TORCH_CHECK(owner[r] >= 0 && owner[r] < tokens && (r == 0 || owner[r] >= owner[r - 1]),
                "row_tokens must be non-decreasing token indices in [0, ", tokens, ")");
  }
  at::Tensor out = at::empty({tokens, rows.size(1)}, rows.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, source.scalar_type(), "local_pairs_combine", [&] {
    combine_rows<scalar_t>(source.const_data_ptr<scalar_t>(), owner, source.size(0), source.size(1),
                           out.mutable_data_ptr<scalar_t>(), tokens);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eplb_graph_native, m) {
  m.def(
      "local_pairs_compact(Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, Tensor expert_map) -> "
      "(Tensor rows, Tensor row_weights, Tensor row_ids, Tensor row_tokens)",
      &local_pairs_compact);
  m.def("local_pairs_combine(Tensor rows, Tensor row_tokens, int tokens) -> Tensor", &local_pairs_combine);
}
