// map_and_record_layer's CPU kernel in C++: the routing op with no Python on its call path.
//
// The op the FX pass inserts names its layer by a string and reads that layer's live tables
// at every call (custom_ops/layer_routing.py says why). A Python kernel pays the
// dispatcher's trip into Python and the Python around its loop, ~26 us per call right after
// a compiled forward; this kernel is reached from the dispatcher directly.
//
// It keeps its own index, layer key -> the five table tensors, mirrored from the Python
// LayerTableRegistry: bound when a layer is registered or rebinds its load buffer, unbound
// when it is closed or dies. The tensors are held, not copied: refreshes happen in place,
// so the next call sees them, as a captured graph must. Semantics are
// routing.map_and_record_composite's (the tests hold both to one Python reference).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

namespace {

// floor(2^32 / golden ratio): Knuth's multiplicative hash of the row, as upstream vLLM.
constexpr uint64_t kKnuthMultiplier = 2654435769ULL;
constexpr uint64_t kHashMask = 0xFFFFFFFFULL;

struct LayerTables {
  at::Tensor lookup;               // [num_logical, max_replicas] int32, -1 padded
  at::Tensor replica_count;        // [num_logical] int32
  at::Tensor load;                 // [num_physical] int32 / int64 / float32 / float64
  at::Tensor record_enabled;       // 1 element, bool or integer
  at::Tensor num_unpadded_tokens;  // 1 element, integer
  c10::Device device{c10::kCPU};   // the first table not on the CPU, if any: this kernel cannot route it
  std::atomic<int64_t> calls{0};   // kernel calls that routed by these tables
};

class LayerIndex {
 public:
  // A key bound again (its layer rebound a load buffer) keeps its call count.
  void bind(const std::string& key, std::shared_ptr<LayerTables> tables) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto found = layers_.find(key);
    if (found != layers_.end()) {
      tables->calls.store(found->second->calls.load());
    }
    layers_[key] = std::move(tables);
  }

  void unbind(const std::string& key) {
    std::lock_guard<std::mutex> guard(mutex_);
    layers_.erase(key);
  }

  // Shared, so a layer unbound during a call stays valid until the call ends.
  std::shared_ptr<LayerTables> find(const std::string& key) const {
    std::lock_guard<std::mutex> guard(mutex_);
    auto found = layers_.find(key);
    return found == layers_.end() ? nullptr : found->second;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<LayerTables>> layers_;
};

// One per process, like the op registration that reads it.
LayerIndex& layer_index() {
  static LayerIndex index;
  return index;
}

std::string python_shape(const at::Tensor& tensor) {
  // "(4,)" / "(2, 3)": the Python kernels' wording, so errors read the same on every path.
  std::ostringstream text;
  text << "(";
  for (int64_t d = 0; d < tensor.dim(); ++d) {
    text << (d ? ", " : "") << tensor.size(d);
  }
  text << (tensor.dim() == 1 ? ",)" : ")");
  return text.str();
}

std::string torch_dtype(const at::Tensor& tensor) {
  std::string name = c10::toString(tensor.scalar_type());  // "Float", "Long", ...
  static const std::unordered_map<std::string, std::string> python_names = {
      {"Float", "float32"}, {"Double", "float64"}, {"Half", "float16"}, {"BFloat16", "bfloat16"},
      {"Int", "int32"},     {"Long", "int64"},    {"Short", "int16"},  {"Char", "int8"},
      {"Byte", "uint8"},    {"Bool", "bool"}};
  auto found = python_names.find(name);
  return "torch." + (found == python_names.end() ? name : found->second);
}

bool is_flag_dtype(at::ScalarType dtype) {
  return dtype == at::kBool || dtype == at::kInt || dtype == at::kLong;
}

// A flag's current value, read at every call (a Python int would be frozen into a graph).
int64_t read_flag(const at::Tensor& flag) {
  switch (flag.scalar_type()) {
    case at::kBool:
      return *flag.const_data_ptr<bool>() ? 1 : 0;
    case at::kInt:
      return *flag.const_data_ptr<int32_t>();
    default:
      return *flag.const_data_ptr<int64_t>();
  }
}

template <typename Id, typename Load>
void route_rows(const at::Tensor& topk_ids, at::Tensor& physical, const LayerTables& tables, bool counting,
                int64_t limit) {
  const int64_t num_tokens = topk_ids.size(0), top_k = topk_ids.size(1);
  const int64_t id_row = topk_ids.stride(0), id_col = topk_ids.stride(1);
  const int64_t out_row = physical.stride(0), out_col = physical.stride(1);
  const int64_t num_logical = tables.lookup.size(0), lookup_row = tables.lookup.stride(0);
  const int64_t lookup_col = tables.lookup.stride(1), count_stride = tables.replica_count.stride(0);
  const int64_t num_physical = tables.load.size(0);
  const Id* ids = topk_ids.const_data_ptr<Id>();
  Id* out = physical.mutable_data_ptr<Id>();
  const int32_t* lookup = tables.lookup.const_data_ptr<int32_t>();
  const int32_t* replica_count = tables.replica_count.const_data_ptr<int32_t>();
  Load* load = tables.load.mutable_data_ptr<Load>();

  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t replica_hash = static_cast<int64_t>((static_cast<uint64_t>(t) * kKnuthMultiplier) & kHashMask);
    const bool counted_row = counting && t < limit;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t expert = static_cast<int64_t>(ids[t * id_row + k * id_col]);
      Id& slot_out = out[t * out_row + k * out_col];
      if (expert < 0 || expert >= num_logical) {  // masked or invalid ids route nowhere
        slot_out = static_cast<Id>(-1);
        continue;
      }
      const int64_t count = std::max<int64_t>(replica_count[expert * count_stride], 1);
      const int64_t slot = lookup[expert * lookup_row + (replica_hash % count) * lookup_col];
      slot_out = static_cast<Id>(slot);
      if (counted_row && slot >= 0 && slot < num_physical) {
        load[slot] += 1;
      }
    }
  }
}

template <typename Id>
void route(const at::Tensor& topk_ids, at::Tensor& physical, const LayerTables& tables, bool counting,
           int64_t limit) {
  switch (tables.load.scalar_type()) {
    case at::kInt:
      return route_rows<Id, int32_t>(topk_ids, physical, tables, counting, limit);
    case at::kLong:
      return route_rows<Id, int64_t>(topk_ids, physical, tables, counting, limit);
    case at::kFloat:
      return route_rows<Id, float>(topk_ids, physical, tables, counting, limit);
    default:
      return route_rows<Id, double>(topk_ids, physical, tables, counting, limit);
  }
}

at::Tensor map_and_record_layer_cpu(const at::Tensor& topk_ids, c10::string_view layer) {
  TORCH_CHECK(topk_ids.dim() == 2, "topk_ids must be [T, K], got ", python_shape(topk_ids));
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "topk_ids must be int32 or int64, got ", torch_dtype(topk_ids));
  const std::string key(layer);
  std::shared_ptr<LayerTables> tables = layer_index().find(key);
  TORCH_CHECK(tables != nullptr, "no live EPLB layer named '", key,
              "': the graph was compiled for an EplbHandle that no longer exists");
  TORCH_CHECK(tables->device.is_cpu(), "EPLB layer '", key, "' has its tables on ", tables->device,
              ", the topk_ids on the CPU");
  tables->calls.fetch_add(1, std::memory_order_relaxed);

  at::Tensor physical = at::empty_like(topk_ids);  // [T, K]
  const bool counting = read_flag(tables->record_enabled) != 0;
  const int64_t limit = read_flag(tables->num_unpadded_tokens);
  if (topk_ids.scalar_type() == at::kInt) {
    route<int32_t>(topk_ids, physical, *tables, counting, limit);
  } else {
    route<int64_t>(topk_ids, physical, *tables, counting, limit);
  }
  return physical;
}

// Checked once here, so the kernel reads raw pointers without checking again. Layers on
// other devices are bound too (every layer is mirrored), and refused only if called here.
void bind_layer(c10::string_view key, const at::Tensor& lookup, const at::Tensor& replica_count,
                const at::Tensor& load, const at::Tensor& record_enabled, const at::Tensor& num_unpadded_tokens) {
  c10::Device device = c10::kCPU;
  for (const at::Tensor* table : {&lookup, &replica_count, &load, &record_enabled, &num_unpadded_tokens}) {
    if (device.is_cpu() && !table->device().is_cpu()) {
      device = table->device();
    }
  }
  TORCH_CHECK(lookup.dim() == 2 && lookup.scalar_type() == at::kInt, "layer '", key,
              "': lookup must be [num_logical, max_replicas] int32");
  TORCH_CHECK(replica_count.dim() == 1 && replica_count.size(0) == lookup.size(0) &&
                  replica_count.scalar_type() == at::kInt,
              "layer '", key, "': replica_count must be [", lookup.size(0), "] int32");
  const at::ScalarType load_dtype = load.scalar_type();
  TORCH_CHECK(load.dim() == 1 && load.is_contiguous() &&
                  (load_dtype == at::kInt || load_dtype == at::kLong || load_dtype == at::kFloat ||
                   load_dtype == at::kDouble),
              "layer '", key, "': load must be a contiguous 1-d int32/int64/float32/float64 tensor");
  TORCH_CHECK(record_enabled.numel() == 1 && is_flag_dtype(record_enabled.scalar_type()), "layer '", key,
              "': record_enabled must be one bool/int32/int64 element");
  TORCH_CHECK(num_unpadded_tokens.numel() == 1 && num_unpadded_tokens.scalar_type() != at::kBool &&
                  is_flag_dtype(num_unpadded_tokens.scalar_type()),
              "layer '", key, "': num_unpadded_tokens must be one int32/int64 element");
  auto tables = std::make_shared<LayerTables>();
  tables->lookup = lookup;
  tables->replica_count = replica_count;
  tables->load = load;
  tables->record_enabled = record_enabled;
  tables->num_unpadded_tokens = num_unpadded_tokens;
  tables->device = device;
  layer_index().bind(std::string(key), std::move(tables));
}

void unbind_layer(c10::string_view key) { layer_index().unbind(std::string(key)); }

// Calls routed for key since it was bound (0 when nothing is bound).
int64_t layer_calls(c10::string_view key) {
  std::shared_ptr<LayerTables> tables = layer_index().find(std::string(key));
  return tables == nullptr ? 0 : tables->calls.load(std::memory_order_relaxed);
}

}  // namespace

// The index's interface, for custom_ops/native_routing.py; a namespace of its own, since
// eplb_graph's schemas are defined from Python.
TORCH_LIBRARY(eplb_graph_native, m) {
  m.def(
      "bind_layer(str key, Tensor lookup, Tensor replica_count, Tensor load, Tensor record_enabled, "
      "Tensor num_unpadded_tokens) -> ()",
      &bind_layer);
  m.def("unbind_layer(str key) -> ()", &unbind_layer);
  m.def("layer_calls(str key) -> int", &layer_calls);
}

TORCH_LIBRARY_IMPL(eplb_graph, CPU, m) {
  m.impl("map_and_record_layer", TORCH_FN(map_and_record_layer_cpu));
}
