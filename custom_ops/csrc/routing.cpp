// The routing ops' CPU kernels in C++: no Python on their call path.
//
// The ops run once per MoE layer per forward, so per-call overhead is most of their cost; a
// Python kernel pays the dispatcher's trip into Python and the Python around its loop, these
// kernels are reached from the dispatcher directly (benchmarks/bench_op_in_step.py and
// benchmarks/bench_routing_ops.py measure both).
//
// map_to_physical, record_load and map_and_record take their tables as arguments and check
// them as routing.py's check_routing_args / check_record_args do, word for word.
// map_and_record_layer, the op the FX pass inserts, names its layer by a string and reads that
// layer's live tables at every call (custom_ops/layer_routing.py says why), from an index of
// its own: layer key -> the five table tensors, mirrored from the Python LayerTableRegistry,
// bound when a layer is registered or rebinds its load buffer, unbound when it is closed or
// dies. The tensors are held, not copied: refreshes happen in place, so the next call sees
// them, as a captured graph must. Semantics are routing.py's composite (the tests hold both to
// one Python reference).

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cctype>
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

// --- Python's wording, so errors read the same on every path --------------------------------

std::string python_shape(const at::Tensor& tensor) {
  // "()" / "(4,)" / "(2, 3)", as tuple(tensor.shape) prints.
  std::ostringstream text;
  text << "(";
  for (int64_t d = 0; d < tensor.dim(); ++d) {
    text << (d ? ", " : "") << tensor.size(d);
  }
  text << (tensor.dim() == 1 ? ",)" : ")");
  return text.str();
}

std::string torch_dtype(const at::Tensor& tensor) {
  // c10's name ("Float", "Long", "Float8_e4m3fn", ...) -> torch's ("torch.float32", ...): the
  // names below differ, every other is c10's lower-cased.
  static const std::unordered_map<std::string, std::string> python_names = {
      {"Float", "float32"},       {"Double", "float64"},       {"Half", "float16"},
      {"Int", "int32"},           {"Long", "int64"},           {"Short", "int16"},
      {"Char", "int8"},           {"Byte", "uint8"},           {"ComplexHalf", "complex32"},
      {"ComplexFloat", "complex64"}, {"ComplexDouble", "complex128"}};
  std::string name = c10::toString(tensor.scalar_type());
  auto found = python_names.find(name);
  if (found != python_names.end()) {
    return "torch." + found->second;
  }
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  return "torch." + name;
}

// --- argument checks: routing.py's, in its order and words -----------------------------------

bool is_id_dtype(const at::Tensor& tensor) {
  return tensor.scalar_type() == at::kInt || tensor.scalar_type() == at::kLong;
}

bool is_flag_dtype(const at::Tensor& tensor) { return tensor.scalar_type() == at::kBool || is_id_dtype(tensor); }

void check_ids(const at::Tensor& topk_ids) {
  TORCH_CHECK(topk_ids.dim() == 2, "topk_ids must be [T, K], got ", python_shape(topk_ids));
  TORCH_CHECK(is_id_dtype(topk_ids), "topk_ids must be int32 or int64, got ", torch_dtype(topk_ids));
}

void check_routing_args(const at::Tensor& topk_ids, const at::Tensor& lookup, const at::Tensor& replica_count) {
  check_ids(topk_ids);
  TORCH_CHECK(lookup.dim() == 2, "lookup must be [num_logical, max_replicas], got ", python_shape(lookup));
  TORCH_CHECK(lookup.scalar_type() == at::kInt, "lookup must be int32, got ", torch_dtype(lookup));
  TORCH_CHECK(replica_count.dim() == 1 && replica_count.size(0) == lookup.size(0),
              "replica_count must be [num_logical=", lookup.size(0), "], got ", python_shape(replica_count));
  TORCH_CHECK(replica_count.scalar_type() == at::kInt, "replica_count must be int32, got ",
              torch_dtype(replica_count));
}

void check_record_args(const at::Tensor& physical_ids, const at::Tensor& load, const at::Tensor& record_enabled,
                       const at::Tensor& num_unpadded_tokens) {
  TORCH_CHECK(physical_ids.dim() == 2, "physical_ids must be [T, K], got ", python_shape(physical_ids));
  TORCH_CHECK(is_id_dtype(physical_ids), "physical_ids must be int32 or int64, got ", torch_dtype(physical_ids));
  TORCH_CHECK(load.dim() == 1, "load must be [num_physical], got ", python_shape(load));
  TORCH_CHECK(load.is_contiguous(), "load must be contiguous");
  TORCH_CHECK(record_enabled.numel() == 1, "record_enabled must be a 0-dim or 1-element tensor, got ",
              python_shape(record_enabled));
  TORCH_CHECK(is_flag_dtype(record_enabled), "record_enabled must be bool, int32 or int64, got ",
              torch_dtype(record_enabled));
  TORCH_CHECK(num_unpadded_tokens.numel() == 1, "num_unpadded_tokens must be a 0-dim or 1-element tensor, got ",
              python_shape(num_unpadded_tokens));
  TORCH_CHECK(is_id_dtype(num_unpadded_tokens), "num_unpadded_tokens must be int32 or int64, got ",
              torch_dtype(num_unpadded_tokens));
}

// --- the loops --------------------------------------------------------------------------------

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

// Rows whose slots are counted: those below the unpadded count, none while recording is off.
int64_t counted_rows(const at::Tensor& record_enabled, const at::Tensor& num_unpadded_tokens) {
  return read_flag(record_enabled) != 0 ? read_flag(num_unpadded_tokens) : 0;
}

// Where counts go: load[slot] += 1 for a slot in [0, num_physical) of a row below `rows`.
// The default one counts nothing (map_to_physical).
template <typename Load>
struct Recorder {
  Load* load = nullptr;
  int64_t num_physical = 0;
  int64_t rows = 0;

  bool counts_row(int64_t t) const { return t < rows; }

  void count(int64_t slot) const {
    if (slot >= 0 && slot < num_physical) {
      load[slot] += Load(1);
    }
  }

  static Recorder into(const at::Tensor& load, int64_t rows) {
    return Recorder{load.mutable_data_ptr<Load>(), load.size(0), rows};
  }
};

// The routing loop of map_to_physical, map_and_record and map_and_record_layer: row t's ids
// [K] -> physical slots (Knuth hash of t modulo the expert's replica count, -1 for ids outside
// [0, num_logical)), each slot counted by `recorder`. Any strides: ids may be a transposed top-k.
// Table values are trusted, as the composite trusts them, but never read outside the tables: a
// replica count beyond the lookup's width is taken as its width, a lookup with no slots routes nothing.
template <typename Id, typename Load>
void route_rows(const at::Tensor& topk_ids, const at::Tensor& physical, const at::Tensor& lookup,
                const at::Tensor& replica_count, const Recorder<Load>& recorder) {
  const int64_t num_tokens = topk_ids.size(0), top_k = topk_ids.size(1);
  const int64_t id_row = topk_ids.stride(0), id_col = topk_ids.stride(1);
  const int64_t out_row = physical.stride(0), out_col = physical.stride(1);
  const int64_t max_replicas = lookup.size(1), num_logical = max_replicas > 0 ? lookup.size(0) : 0;
  const int64_t lookup_row = lookup.stride(0), lookup_col = lookup.stride(1);
  const int64_t count_stride = replica_count.stride(0);
  const Id* ids = topk_ids.const_data_ptr<Id>();
  Id* out = physical.mutable_data_ptr<Id>();
  const int32_t* slots = lookup.const_data_ptr<int32_t>();
  const int32_t* counts = replica_count.const_data_ptr<int32_t>();

  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t replica_hash = static_cast<int64_t>((static_cast<uint64_t>(t) * kKnuthMultiplier) & kHashMask);
    const bool counted_row = recorder.counts_row(t);
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t expert = static_cast<int64_t>(ids[t * id_row + k * id_col]);
      Id& slot_out = out[t * out_row + k * out_col];
      if (expert < 0 || expert >= num_logical) {  // masked or invalid ids route nowhere
        slot_out = static_cast<Id>(-1);
        continue;
      }
      const int64_t count = std::clamp<int64_t>(counts[expert * count_stride], 1, max_replicas);
      const int64_t slot = slots[expert * lookup_row + (replica_hash % count) * lookup_col];
      slot_out = static_cast<Id>(slot);
      if (counted_row) {
        recorder.count(slot);
      }
    }
  }
}

// record_load's loop: its ids are physical already, so it only counts.
template <typename Id, typename Load>
void record_rows(const at::Tensor& physical_ids, const Recorder<Load>& recorder) {
  const int64_t rows = std::min(physical_ids.size(0), recorder.rows), top_k = physical_ids.size(1);
  const int64_t id_row = physical_ids.stride(0), id_col = physical_ids.stride(1);
  const Id* ids = physical_ids.const_data_ptr<Id>();
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      recorder.count(static_cast<int64_t>(ids[t * id_row + k * id_col]));
    }
  }
}

template <typename T>
struct Type {
  using type = T;
};

// Runs body(Type<Id>, Type<Load>) for the ids' dtype (int32 or int64, checked before) and the
// load's: every dtype the torch composite counts into (index_add_'s).
template <typename Body>
void dispatch_ids_and_load(const at::Tensor& ids, const at::Tensor& load, const Body& body) {
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "eplb_graph routing ids", [&] {
    using Id = index_t;
    AT_DISPATCH_V2(load.scalar_type(), "eplb_graph load recording",
                   AT_WRAP([&] { body(Type<Id>{}, Type<scalar_t>{}); }), AT_EXPAND(AT_ALL_TYPES_AND_COMPLEX),
                   at::kHalf, at::kBFloat16, at::kBool, at::kComplexHalf);
  });
}

// map_and_record on tables of checked shapes and dtypes: what it and map_and_record_layer run.
at::Tensor route(const at::Tensor& topk_ids, const at::Tensor& lookup, const at::Tensor& replica_count,
                 const at::Tensor& load, int64_t rows) {
  at::Tensor physical = at::empty_like(topk_ids);  // [T, K]
  dispatch_ids_and_load(topk_ids, load, [&](auto id, auto counted) {
    using Id = typename decltype(id)::type;
    using Load = typename decltype(counted)::type;
    route_rows<Id, Load>(topk_ids, physical, lookup, replica_count, Recorder<Load>::into(load, rows));
  });
  return physical;
}

// --- the table-taking ops ---------------------------------------------------------------------

at::Tensor map_to_physical_cpu(const at::Tensor& topk_ids, const at::Tensor& lookup, const at::Tensor& replica_count) {
  check_routing_args(topk_ids, lookup, replica_count);
  at::Tensor physical = at::empty_like(topk_ids);  // [T, K]
  AT_DISPATCH_INDEX_TYPES(topk_ids.scalar_type(), "map_to_physical", [&] {
    route_rows<index_t, int64_t>(topk_ids, physical, lookup, replica_count, Recorder<int64_t>{});
  });
  return physical;
}

void record_load_cpu(const at::Tensor& physical_ids, const at::Tensor& load, const at::Tensor& record_enabled,
                     const at::Tensor& num_unpadded_tokens) {
  check_record_args(physical_ids, load, record_enabled, num_unpadded_tokens);
  const int64_t rows = counted_rows(record_enabled, num_unpadded_tokens);
  dispatch_ids_and_load(physical_ids, load, [&](auto id, auto counted) {
    using Id = typename decltype(id)::type;
    using Load = typename decltype(counted)::type;
    record_rows<Id, Load>(physical_ids, Recorder<Load>::into(load, rows));
  });
}

at::Tensor map_and_record_cpu(const at::Tensor& topk_ids, const at::Tensor& lookup, const at::Tensor& replica_count,
                              const at::Tensor& load, const at::Tensor& record_enabled,
                              const at::Tensor& num_unpadded_tokens) {
  check_routing_args(topk_ids, lookup, replica_count);
  check_record_args(topk_ids, load, record_enabled, num_unpadded_tokens);
  return route(topk_ids, lookup, replica_count, load, counted_rows(record_enabled, num_unpadded_tokens));
}

// --- map_and_record_layer and its index of layers ---------------------------------------------

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

at::Tensor map_and_record_layer_cpu(const at::Tensor& topk_ids, c10::string_view layer) {
  check_ids(topk_ids);
  const std::string key(layer);
  std::shared_ptr<LayerTables> tables = layer_index().find(key);
  TORCH_CHECK(tables != nullptr, "no live EPLB layer named '", key,
              "': the graph was compiled for an EplbHandle that no longer exists");
  TORCH_CHECK(tables->device.is_cpu(), "EPLB layer '", key, "' has its tables on ", tables->device,
              ", the topk_ids on the CPU");
  tables->calls.fetch_add(1, std::memory_order_relaxed);
  return route(topk_ids, tables->lookup, tables->replica_count, tables->load,
               counted_rows(tables->record_enabled, tables->num_unpadded_tokens));
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
  TORCH_CHECK(record_enabled.numel() == 1 && is_flag_dtype(record_enabled), "layer '", key,
              "': record_enabled must be one bool/int32/int64 element");
  TORCH_CHECK(num_unpadded_tokens.numel() == 1 && is_id_dtype(num_unpadded_tokens), "layer '", key,
              "': num_unpadded_tokens must be one int32/int64 element");
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
// eplb_graph's schemas are defined from Python (custom_ops/routing.py, layer_routing.py).
TORCH_LIBRARY(eplb_graph_native, m) {
  m.def(
      "bind_layer(str key, Tensor lookup, Tensor replica_count, Tensor load, Tensor record_enabled, "
      "Tensor num_unpadded_tokens) -> ()",
      &bind_layer);
  m.def("unbind_layer(str key) -> ()", &unbind_layer);
  m.def("layer_calls(str key) -> int", &layer_calls);
}

TORCH_LIBRARY_IMPL(eplb_graph, CPU, m) {
  m.impl("map_to_physical", TORCH_FN(map_to_physical_cpu));
  m.impl("record_load", TORCH_FN(record_load_cpu));
  m.impl("map_and_record", TORCH_FN(map_and_record_cpu));
  m.impl("map_and_record_layer", TORCH_FN(map_and_record_layer_cpu));
}
