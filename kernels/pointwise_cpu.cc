// onnxfuse.Pointwise for CPUExecutionProvider: kernel creation, run-time shape resolution,
// threading, and the baseline build of the block executor.
#include "pointwise_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "numeric.h"
#include "kernel_util.h"
#include "registry.h"

namespace onnxfuse {
namespace isa_base {
#include "pointwise_exec.inc"
}  // namespace isa_base

CompiledProgram::CompiledProgram(Program p) : program(std::move(p)) {
  const int nin = static_cast<int>(program.inputs.size());
  const int nvals = program.num_values();
  // A value written straight into an output buffer needs no register: the first output of the
  // compute type that stores an instruction result receives it.
  direct_output.assign(nvals, -1);
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    const ProgramOutput& out = program.outputs[o];
    if (out.value >= nin && out.dtype == program.compute && direct_output[out.value] < 0)
      direct_output[out.value] = static_cast<int>(o);
  }
  // Register slots by liveness: a slot is free again after the last instruction reading it.
  // Values read by outputs stay live to the end of the block.
  std::vector<int> last_use(nvals, -1);
  const int end = static_cast<int>(program.instrs.size());
  for (int k = 0; k < end; ++k) {
    const Instr& ins = program.instrs[k];
    for (int a = 0; a < op_info(ins.op).arity; ++a)
      if (!ins.args[a].is_literal) last_use[ins.args[a].value] = k;
  }
  for (const ProgramOutput& out : program.outputs) last_use[out.value] = end;
  slot.assign(program.instrs.size(), -1);
  std::vector<int> free_slots;
  std::vector<int> slot_of_value(nvals, -1);
  for (int k = 0; k < end; ++k) {
    const Instr& ins = program.instrs[k];
    // Operands dying here release their slots first, so a result may overwrite an operand
    // (loops are elementwise: each element is read before it is written).
    for (int a = 0; a < op_info(ins.op).arity; ++a) {
      const Operand& o = ins.args[a];
      if (o.is_literal || last_use[o.value] != k || slot_of_value[o.value] < 0) continue;
      free_slots.push_back(slot_of_value[o.value]);
      slot_of_value[o.value] = -1;
    }
    const int value = nin + k;
    if (direct_output[value] >= 0 || last_use[value] < 0) {
      if (direct_output[value] < 0) {
        // Unused result: it still needs somewhere to go; give it a slot freed immediately.
        int s = free_slots.empty() ? num_slots++ : free_slots.back();
        slot[k] = s;
      }
      continue;
    }
    int s;
    if (!free_slots.empty()) {
      s = free_slots.back();
      free_slots.pop_back();
    } else {
      s = num_slots++;
    }
    slot[k] = s;
    slot_of_value[value] = s;
  }
  plan_fused_steps();
}

namespace {

// The stage kind of a chain instruction: unary opcodes by themselves, binary ones by which
// argument (run_arg) carries the running value.
bool chain_kind(Op op, int run_arg, ChainStage::Kind* kind) {
  using K = ChainStage;
  const bool first = run_arg == 0;
  switch (op) {
    case Op::Add: *kind = K::Add; return true;
    case Op::Mul: *kind = K::Mul; return true;
    case Op::Sub: *kind = first ? K::Sub : K::RSub; return true;
    case Op::Div: *kind = first ? K::Div : K::RDiv; return true;
    case Op::Max: *kind = first ? K::Max : K::RMax; return true;
    case Op::Min: *kind = first ? K::Min : K::RMin; return true;
    case Op::Neg: *kind = K::Neg; return true;
    case Op::Abs: *kind = K::Abs; return true;
    case Op::Relu: *kind = K::Relu; return true;
    case Op::Sqrt: *kind = K::Sqrt; return true;
    case Op::Recip: *kind = K::Recip; return true;
    case Op::Floor: *kind = K::Floor; return true;
    case Op::Ceil: *kind = K::Ceil; return true;
    case Op::Round: *kind = K::Round; return true;
    case Op::LeakyRelu: *kind = K::LeakyRelu; return true;
    case Op::Clip: *kind = K::Clip; return true;
    case Op::Exp: *kind = K::Exp; return true;
    case Op::Log: *kind = K::Log; return true;
    case Op::Erf: *kind = K::Erf; return true;
    case Op::Tanh: *kind = K::Tanh; return true;
    case Op::Sigmoid: *kind = K::Sigmoid; return true;
    default: return false;
  }
}

}  // namespace

bool chain_op(Op op) {
  ChainStage::Kind k;
  return chain_kind(op, 0, &k);
}

namespace {

// Segments in order: each elementary function with up to kMaxAffine affine stages right before
// and after it (taken greedily, after it first), each run of other stages alone.
int plan_segments(const ChainStage* stages, int count, ChainSegment* segments) {
  int num = 0;
  const auto kind = [stages](int s) { return stages[s].kind; };
  for (int i = 0; i < count;) {
    int f = i;
    while (f < count && !elementary_kind(kind(f))) ++f;
    int pre = f;
    if (f < count)
      while (pre > i && f - pre < kMaxAffine && affine_kind(kind(pre - 1))) --pre;
    if (pre > i) segments[num++] = {i, pre - i, -1};
    if (f == count) break;
    int post = f + 1;
    while (post < count && post - f - 1 < kMaxAffine && affine_kind(kind(post))) ++post;
    segments[num++] = {pre, post - pre, f - pre};
    i = post;
  }
  return num;
}

}  // namespace

void CompiledProgram::plan_fused_steps() {
  const int nin = static_cast<int>(program.inputs.size());
  const int end = static_cast<int>(program.instrs.size());
  step_at.assign(end, -1);
  if (program.compute != DType::F32) return;
  // Reads of each value, by instructions and by outputs.
  std::vector<int> uses(program.num_values(), 0);
  for (const Instr& ins : program.instrs)
    for (int a = 0; a < op_info(ins.op).arity; ++a)
      if (!ins.args[a].is_literal) ++uses[ins.args[a].value];
  for (const ProgramOutput& out : program.outputs) uses[out.value] += 2;  // never absorbed

  std::vector<std::pair<size_t, size_t>> begins;  // each step's first stage and segment
  ChainStage stages[kMaxChain];
  ChainSegment segments[kMaxChain];
  for (int k = 0; k < end;) {
    FusedStep st;
    st.first = k;
    int i = k;
    for (; i < end && i - k < kMaxChain; ++i) {
      const Instr& ins = program.instrs[i];
      const int arity = op_info(ins.op).arity;
      if (!chain_op(ins.op)) break;
      // The argument carrying the running value: for the first instruction a value (not a
      // literal; the first when both are values), afterwards the previous result, which must be
      // read exactly once, here.
      int run_arg = -1;
      if (i == k) {
        for (int a = arity - 1; a >= 0; --a)
          if (!ins.args[a].is_literal) run_arg = a;
      } else {
        const int prev = nin + i - 1;
        if (uses[prev] != 1) break;
        for (int a = 0; a < arity; ++a)
          if (!ins.args[a].is_literal && ins.args[a].value == prev) run_arg = a;
      }
      if (run_arg < 0) break;
      ChainStage& stage = stages[i - k];
      chain_kind(ins.op, run_arg, &stage.kind);
      stage.instr = i;
      stage.other = arity == 2 ? 1 - run_arg : -1;
      stage.p0 = static_cast<float>(ins.params[0]);
      stage.p1 = static_cast<float>(ins.params[1]);
      if (i == k) st.input_arg = run_arg;
    }
    st.count = i - k;
    if (st.count >= 2) {
      st.num_segments = plan_segments(stages, st.count, segments);
      begins.emplace_back(chain_stages.size(), chain_segments.size());
      chain_stages.insert(chain_stages.end(), stages, stages + st.count);
      chain_segments.insert(chain_segments.end(), segments, segments + st.num_segments);
      step_at[k] = static_cast<int>(steps.size());
      steps.push_back(st);
      k = i;
    } else {
      k += 1;
    }
  }
  // Pointers once the vectors are complete (appending may have moved them).
  for (size_t j = 0; j < steps.size(); ++j) {
    steps[j].stages = chain_stages.data() + begins[j].first;
    steps[j].segments = chain_segments.data() + begins[j].second;
  }
}

void init_geometry(ExecJob* job) {
  job->inner = job->shape[job->rank - 1];
  int64_t numel = 1;
  for (int d = 0; d < job->rank; ++d) numel *= job->shape[d];
  job->rows = job->inner ? numel / job->inner : 0;
  // Rows shorter than kBlock go several to a block, through registers: a streaming job's blocks
  // grow only where a block is a chunk of one row.
  job->block = job->streaming && job->inner >= kBlock ? kStreamBlock : kBlock;
  if (job->inner >= kBlock) {
    // Chunks of equal length, rounded up to a multiple of 16 elements: the vector loops then run
    // without a remainder except in a row's last chunk, and chunks of a float32 row start on
    // 64-byte boundaries (an odd length such as 1021 for a row of 1e5 would send every chunk
    // through the scalar remainder path and misalign the next).
    const int64_t chunks = (job->inner + job->block - 1) / job->block;
    job->chunk = ((job->inner + chunks - 1) / chunks + 15) & ~static_cast<int64_t>(15);
    job->chunks_per_row = (job->inner + job->chunk - 1) / job->chunk;
    job->num_blocks = job->rows * job->chunks_per_row;
    job->rows_per_block = 0;
  } else {
    job->chunks_per_row = 0;
    job->rows_per_block = job->inner ? kBlock / job->inner : 1;
    job->num_blocks = (job->rows + job->rows_per_block - 1) / job->rows_per_block;
  }
  // About kTaskElements per task, in tasks of equal size whose count is a multiple of 4 when
  // there are several: the thread pool hands each thread a contiguous share of the tasks, so
  // 1e5 elements as 32+32+32+2 blocks gave one of two threads 64 blocks and the other 34.
  const int64_t target = std::max<int64_t>(1, kTaskElements / job->block);
  int64_t tasks = (job->num_blocks + target - 1) / target;
  if (tasks > 1) tasks = std::min(job->num_blocks, (tasks + 3) & ~static_cast<int64_t>(3));
  job->blocks_per_task = tasks > 0 ? (job->num_blocks + tasks - 1) / tasks : 1;
  job->num_tasks = (job->num_blocks + job->blocks_per_task - 1) / job->blocks_per_task;
}

RunTaskFn select_run_task() {
#if defined(__x86_64__)
  if (use_avx2_fma()) return isa_avx2::run_task;
#endif
  return isa_base::run_task;
}

ApplyUnaryFn select_apply_unary_f32() {
#if defined(__x86_64__)
  if (use_avx2_fma()) return isa_avx2::apply_unary_f32;
#endif
  return isa_base::apply_unary_f32;
}

bool parse_unary_f32(const std::string& spec, Instr* out, std::string* error) {
  Program prog;
  if (!Program::parse("in x0 f32\nt0 = " + spec + " x0\nout t0 f32\n", &prog, error)) return false;
  const OpInfo& info = op_info(prog.instrs[0].op);
  if (info.arity != 1 || info.predicate || prog.instrs[0].op == Op::Cast) {
    *error = "'" + spec + "' is not an activation";
    return false;
  }
  *out = prog.instrs[0];
  return true;
}

namespace {

// The C API version that lets a kernel read an input's type and shape without an allocation.
constexpr uint32_t kShapeReferenceApi = 24;

// Inputs/outputs up to this count and ranks up to kInlineRank live in fixed arrays on the stack;
// larger nodes fall back to the heap.
constexpr size_t kInlineValues = 16;
constexpr size_t kInlineRank = 8;

// n values of T in place when n <= N, on the heap beyond.
template <class T, size_t N>
class InlineArray {
 public:
  explicit InlineArray(size_t n) {
    if (n > N) {
      heap_.reset(new T[n]);
      data_ = heap_.get();
    }
  }
  T& operator[](size_t i) { return data_[i]; }
  T* data() { return data_; }

 private:
  T inline_[N];
  std::unique_ptr<T[]> heap_;
  T* data_ = inline_;
};

// The iteration plan for one combination of input shapes, ready to run: resolve_plan's result in
// flat arrays plus the executor's block geometry.
struct ResolvedPlan {
  std::vector<int64_t> key;  // per input: rank, then its dimensions
  std::vector<int64_t> out_shape;
  std::vector<int64_t> shape;    // collapsed iteration shape
  std::vector<int64_t> offsets;  // per input
  std::vector<int64_t> strides;  // per input, shape.size() each
  int64_t numel = 0;
  ExecJob job;  // prog, shape and geometry; inputs and outputs are set per run

  bool matches(size_t n, const size_t* ranks, const int64_t* const* dims) const {
    const int64_t* k = key.data();
    for (size_t i = 0; i < n; ++i) {
      if (static_cast<size_t>(*k++) != ranks[i]) return false;
      if (ranks[i] && std::memcmp(k, dims[i], ranks[i] * sizeof(int64_t)) != 0) return false;
      k += ranks[i];
    }
    return true;
  }
};

// Plans of the input shapes a kernel has seen. A model runs with the same shapes again and again,
// so Compute resolves views and broadcasting once per shape combination. onnxruntime may call
// Compute of one kernel concurrently (several threads running one session), so entries are
// published once with compare-and-swap and never replaced or freed before the kernel: readers
// need no lock. Past kSlots distinct shape combinations, plans are resolved per call.
class PlanCache {
 public:
  static constexpr int kSlots = 8;
  PlanCache() {
    for (auto& s : slots_) s.store(nullptr, std::memory_order_relaxed);
  }
  PlanCache(const PlanCache&) = delete;
  PlanCache& operator=(const PlanCache&) = delete;
  ~PlanCache() {
    for (auto& s : slots_) delete s.load(std::memory_order_relaxed);
  }
  const ResolvedPlan* find(size_t n, const size_t* ranks, const int64_t* const* dims) const {
    for (const auto& s : slots_) {
      const ResolvedPlan* p = s.load(std::memory_order_acquire);
      if (p == nullptr) return nullptr;  // slots fill in order
      if (p->matches(n, ranks, dims)) return p;
    }
    return nullptr;
  }
  // True when the cache took ownership of `plan`.
  bool publish(const ResolvedPlan* plan) {
    for (auto& s : slots_) {
      const ResolvedPlan* expected = nullptr;
      if (s.compare_exchange_strong(expected, plan, std::memory_order_acq_rel)) return true;
    }
    return false;
  }

 private:
  std::atomic<const ResolvedPlan*> slots_[kSlots];
};

struct PointwiseKernel {
  OrtApiRef api;
  CompiledProgram prog;
  std::string node_name;
  RunTaskFn run_task;
  bool shape_reference;  // the runtime serves GetTensorElementTypeAndShapeDataReference
  std::vector<ONNXTensorElementDataType> input_types;
  // Output element types are fixed by the graph: checked on the first run that gets them all,
  // which records the type each output is stored as (the program's, or a float substitute).
  std::atomic<bool> outputs_checked{false};
  std::unique_ptr<std::atomic<uint8_t>[]> output_dtypes;
  PlanCache plans;

  PointwiseKernel(OrtApiRef a, Program p, std::string name)
      : api(a), prog(std::move(p)), node_name(std::move(name)), run_task(select_run_task()) {
    shape_reference = runtime_serves_api(kShapeReferenceApi) && std::getenv("ONNXFUSE_NO_SHAPE_REFERENCE") == nullptr;
    for (const ProgramInput& in : prog.program.inputs) input_types.push_back(dtype_to_onnx(in.dtype));
    output_dtypes.reset(new std::atomic<uint8_t>[prog.program.outputs.size()]);
    for (size_t o = 0; o < prog.program.outputs.size(); ++o)
      output_dtypes[o].store(static_cast<uint8_t>(prog.program.outputs[o].dtype), std::memory_order_relaxed);
  }
};

std::string node_label(const std::string& name) {
  return "onnxfuse Pointwise node '" + name + "': ";
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** kernel) noexcept {
  return create_guarded(
      raw, info, fused_ops::Pointwise.name, "",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    size_t size = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_string(info, kProgramAttr, nullptr, &size),
                       where + "string attribute 'program': ");
    std::string text(size, '\0');
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_string(info, kProgramAttr, text.data(), &size), where);
    text.resize(std::strlen(text.c_str()));

    Program program;
    std::string error;
    if (!Program::parse(text, &program, &error))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());

    // Compute relies on these counts: onnxruntime passes the node's inputs and outputs.
    size_t n_in = 0, n_out = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetOutputCount(info, &n_out), where);
    if (n_in != program.inputs.size() || n_out != program.outputs.size()) {
      std::string msg = where + "program declares " + std::to_string(program.inputs.size()) + " inputs and " +
                        std::to_string(program.outputs.size()) + " outputs, the node has " + std::to_string(n_in) +
                        " and " + std::to_string(n_out);
      return api.CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
    }
    *kernel = new PointwiseKernel(api, std::move(program), name);
    return nullptr;
  });
}

const char* type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "f32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "f64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "f16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bf16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    default: return "an unsupported type";
  }
}

// Error statuses of Compute: messages are built only when a run fails.
[[gnu::cold, gnu::noinline]] OrtStatus* run_error(const PointwiseKernel& k, OrtErrorCode code, const std::string& what) {
  return k.api.CreateStatus(code, (node_label(k.node_name) + what).c_str());
}
[[gnu::cold, gnu::noinline]] OrtStatus* run_error(const PointwiseKernel& k, OrtStatus* st) {
  return with_context(k.api, st, node_label(k.node_name));
}
// onnxruntime runs float16 ops without a CPU float16 kernel in float32, inserting Casts around
// them, and then drops Casts next to ops that take any type, such as ours: an input the program
// reads as f16 (or bf16, or f32) can arrive in another of these types. When the program computes
// in f32, such an input is loaded by its actual type, which is the value the dropped Cast would
// have widened (or, in the f32 -> f16 direction, would have rounded: onnxruntime's own float16
// emulation skips that rounding the same way).
bool float_substitute(const Program& prog, DType declared, ONNXTensorElementDataType actual, DType* load_as) {
  if (prog.compute != DType::F32 || declared == DType::Bool || declared == DType::F64) return false;
  switch (actual) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: *load_as = DType::F32; return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: *load_as = DType::F16; return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: *load_as = DType::BF16; return true;
    default: return false;
  }
}

[[gnu::cold, gnu::noinline]] OrtStatus* type_error(const PointwiseKernel& k, const char* what, size_t index,
                                                   ONNXTensorElementDataType got, DType want) {
  return run_error(k, ORT_INVALID_ARGUMENT,
                   std::string(what) + " " + std::to_string(index) + " is " + type_name(got) +
                       (what[0] == 'i' ? ", the program reads " : ", the program writes ") + dtype_name(want));
}

#define ONNXFUSE_RUN_CHECK(call)                             \
  do {                                                       \
    if (OrtStatus* st_ = (call)) return run_error(*kernel, st_); \
  } while (0)

// Reads one input's element type and dimensions through the info object (runtimes before C API
// 24). Dimensions go to `store` (kInlineRank slots) or, for higher ranks, to `overflow`.
OrtStatus* legacy_type_and_shape(const OrtApiRef& api, const OrtValue* value, ONNXTensorElementDataType* type,
                                 int64_t* store, std::vector<int64_t>* overflow, const int64_t** dims,
                                 size_t* rank) {
  OrtTensorTypeAndShapeInfo* ti = nullptr;
  if (OrtStatus* st = api.GetTensorTypeAndShape(value, &ti)) return st;
  OrtStatus* st = api.GetTensorElementType(ti, type);
  if (!st) st = api.GetDimensionsCount(ti, rank);
  if (!st) {
    int64_t* dst = store;
    if (*rank > kInlineRank) {
      overflow->resize(*rank);
      dst = overflow->data();
    }
    st = api.GetDimensions(ti, dst, *rank);
    *dims = dst;
  }
  api.ReleaseTensorTypeAndShapeInfo(ti);
  return st;
}

// Whether a run of the program over this plan can use streaming blocks (kStreamBlock): every
// instruction's result goes to the next stage of its chain or straight into an output (so no
// register is touched, where the AVX2 build runs the chains), and every input is read in place
// (contiguous rows of the compute type) or as one scalar per block (constant along the rows), as
// run_block reads them. A chain whose running value is a scalar per block runs one instruction
// at a time through registers, so it does not stream either.
bool streaming_program(const CompiledProgram& cp, const IterPlan& plan) {
  const Program& prog = cp.program;
  if (prog.compute != DType::F32 || !use_avx2_fma()) return false;
  const int nin = static_cast<int>(prog.inputs.size());
  auto inner_stride = [&](int input) { return plan.inputs[input].strides.back(); };
  for (int i = 0; i < nin; ++i) {
    const DType dtype = prog.inputs[i].dtype;
    const bool in_place = inner_stride(i) == 1 && dtype_size(dtype) == sizeof(float) && dtype != DType::Bool;
    if (inner_stride(i) != 0 && !in_place) return false;
  }
  std::vector<bool> chained(prog.instrs.size(), false);  // a chain's result before its last
  for (const FusedStep& st : cp.steps) {
    const Operand& run = prog.instrs[st.first].args[st.input_arg];
    if (run.is_literal || (run.value < nin && inner_stride(run.value) == 0)) return false;
    for (int k = st.first; k < st.first + st.count - 1; ++k) chained[k] = true;
  }
  for (size_t k = 0; k < prog.instrs.size(); ++k)
    if (!chained[k] && cp.direct_output[nin + k] < 0) return false;
  return true;
}

// Resolves views and broadcasting for these shapes (the slow path, once per shape combination).
bool build_plan(const PointwiseKernel& k, size_t n, const size_t* ranks, const int64_t* const* dims,
                ResolvedPlan* out, std::string* error) {
  std::vector<std::vector<int64_t>> shapes(n);
  for (size_t i = 0; i < n; ++i) {
    shapes[i].assign(dims[i], dims[i] + ranks[i]);
    out->key.push_back(static_cast<int64_t>(ranks[i]));
    out->key.insert(out->key.end(), dims[i], dims[i] + ranks[i]);
  }
  IterPlan plan;
  if (!resolve_plan(k.prog.program, shapes, &plan, error)) return false;
  out->out_shape = plan.out_shape;
  out->shape = plan.shape;
  out->numel = plan.numel;
  for (size_t i = 0; i < n; ++i) {
    out->offsets.push_back(plan.inputs[i].offset);
    out->strides.insert(out->strides.end(), plan.inputs[i].strides.begin(), plan.inputs[i].strides.end());
  }
  out->job.prog = &k.prog;
  out->job.shape = out->shape.data();
  out->job.rank = static_cast<int>(out->shape.size());
  out->job.inputs = nullptr;
  out->job.outputs = nullptr;
  out->job.streaming = streaming_program(k.prog, plan);
  init_geometry(&out->job);
  return true;
}

struct ParallelRun {
  const ExecJob* job;
  RunTaskFn run_task;
  std::atomic<bool> failed{false};
};

void run_one_task(void* data, size_t task) {
  auto* pr = static_cast<ParallelRun*>(data);
  if (pr->failed.load(std::memory_order_relaxed)) return;
  try {
    pr->run_task(*pr->job, static_cast<int64_t>(task));
  } catch (...) {  // nothing may unwind into onnxruntime's thread pool
    pr->failed.store(true);
  }
}

// The per-run path. It allocates nothing for nodes within the inline limits once the plan of the
// input shapes is cached: types and shapes are read by reference, the plan is looked up, the
// outputs are fetched and the blocks run (inline when there is one task).
OrtStatus* compute(void* kernel_ptr, OrtKernelContext* ctx) noexcept {
  auto* kernel = static_cast<PointwiseKernel*>(kernel_ptr);
  const OrtApiRef& api = kernel->api;
  const Program& prog = kernel->prog.program;
  const size_t n_in = prog.inputs.size(), n_out = prog.outputs.size();
  try {
    InlineArray<const unsigned char*, kInlineValues> data(n_in);
    InlineArray<DType, kInlineValues> in_dtypes(n_in);
    InlineArray<const int64_t*, kInlineValues> dims(n_in);
    InlineArray<size_t, kInlineValues> ranks(n_in);
    for (size_t i = 0; i < n_in; ++i) {
      const OrtValue* value = nullptr;
      ONNXFUSE_RUN_CHECK(api.KernelContext_GetInput(ctx, i, &value));
      if (value == nullptr) return run_error(*kernel, ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " is missing");
      ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      if (kernel->shape_reference) {
        ONNXFUSE_RUN_CHECK(api.GetTensorElementTypeAndShapeDataReference(value, &et, &dims[i], &ranks[i]));
      } else {
        // Older runtimes: dimensions are copied out (one fixed slot per input within the limits).
        thread_local std::vector<int64_t> legacy_store;
        thread_local std::vector<std::vector<int64_t>> legacy_overflow;
        if (i == 0) {
          legacy_store.resize(n_in * kInlineRank);
          legacy_overflow.resize(n_in);
        }
        ONNXFUSE_RUN_CHECK(legacy_type_and_shape(api, value, &et, legacy_store.data() + i * kInlineRank,
                                                 &legacy_overflow[i], &dims[i], &ranks[i]));
      }
      if (et != kernel->input_types[i]) {
        if (!float_substitute(prog, prog.inputs[i].dtype, et, &in_dtypes[i]))
          return type_error(*kernel, "input", i, et, prog.inputs[i].dtype);
      } else {
        in_dtypes[i] = prog.inputs[i].dtype;
      }
      void* p = nullptr;
      ONNXFUSE_RUN_CHECK(api.GetTensorMutableData(const_cast<OrtValue*>(value), &p));
      data[i] = static_cast<const unsigned char*>(p);
    }

    const ResolvedPlan* plan = kernel->plans.find(n_in, ranks.data(), dims.data());
    std::unique_ptr<ResolvedPlan> uncached;
    if (plan == nullptr) {
      auto fresh = std::make_unique<ResolvedPlan>();
      std::string error;
      if (!build_plan(*kernel, n_in, ranks.data(), dims.data(), fresh.get(), &error))
        return run_error(*kernel, ORT_INVALID_ARGUMENT, error);
      plan = fresh.get();
      if (kernel->plans.publish(plan))
        fresh.release();
      else
        uncached = std::move(fresh);
    }

    InlineArray<ExecInput, kInlineValues> inputs(n_in);
    const size_t rank = plan->shape.size();
    for (size_t i = 0; i < n_in; ++i)
      inputs[i] = {data[i], in_dtypes[i], plan->offsets[i], plan->strides.data() + i * rank};

    InlineArray<ExecOutput, kInlineValues> outputs(n_out);
    const bool check_types = !kernel->outputs_checked.load(std::memory_order_relaxed);
    bool unallocated = false;
    for (size_t o = 0; o < n_out; ++o) {
      OrtValue* value = nullptr;
      ONNXFUSE_RUN_CHECK(
          api.KernelContext_GetOutput(ctx, o, plan->out_shape.data(), plan->out_shape.size(), &value));
      outputs[o] = {nullptr, static_cast<DType>(kernel->output_dtypes[o].load(std::memory_order_relaxed))};
      if (value == nullptr) {  // an output nobody reads
        unallocated = true;
        continue;
      }
      if (check_types) {
        OrtTensorTypeAndShapeInfo* ti = nullptr;
        ONNXFUSE_RUN_CHECK(api.GetTensorTypeAndShape(value, &ti));
        ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
        OrtStatus* st = api.GetTensorElementType(ti, &et);
        api.ReleaseTensorTypeAndShapeInfo(ti);
        if (st) return run_error(*kernel, st);
        if (et != dtype_to_onnx(prog.outputs[o].dtype)) {
          // A float substitute (see float_substitute) unless the program computes this output
          // straight into the output buffer, which must then be of the compute type.
          DType stored;
          const bool direct = kernel->prog.direct_output[prog.outputs[o].value] == static_cast<int>(o);
          if (direct || !float_substitute(prog, prog.outputs[o].dtype, et, &stored))
            return type_error(*kernel, "output", o, et, prog.outputs[o].dtype);
          kernel->output_dtypes[o].store(static_cast<uint8_t>(stored), std::memory_order_relaxed);
          outputs[o].dtype = stored;
        }
      }
      void* p = nullptr;
      ONNXFUSE_RUN_CHECK(api.GetTensorMutableData(value, &p));
      outputs[o].data = static_cast<unsigned char*>(p);
    }
    if (check_types && !unallocated) kernel->outputs_checked.store(true, std::memory_order_relaxed);
    if (plan->numel == 0) return nullptr;

    // Outputs onnxruntime did not allocate (unused optional results) get a throwaway buffer, so
    // the executor never branches on them.
    std::vector<std::vector<unsigned char>> discard;
    if (unallocated) {
      discard.reserve(n_out);
      for (size_t o = 0; o < n_out; ++o) {
        if (outputs[o].data) continue;
        discard.emplace_back(static_cast<size_t>(plan->numel) * dtype_size(prog.outputs[o].dtype));
        outputs[o].data = discard.back().data();
      }
    }

    ExecJob job = plan->job;
    job.inputs = inputs.data();
    job.outputs = outputs.data();
    if (job.num_tasks == 1) {
      kernel->run_task(job, 0);
      return nullptr;
    }
    ParallelRun pr;
    pr.job = &job;
    pr.run_task = kernel->run_task;
    ONNXFUSE_RUN_CHECK(api.KernelContext_ParallelFor(ctx, run_one_task, static_cast<size_t>(job.num_tasks), 0, &pr));
    if (pr.failed.load()) return run_error(*kernel, ORT_FAIL, "out of memory");
    return nullptr;
  } catch (const std::bad_alloc&) {
    return run_error(*kernel, ORT_FAIL, "out of memory");
  } catch (const std::exception& e) {
    return run_error(*kernel, ORT_FAIL, e.what());
  }
}

ONNXFUSE_REGISTER_FUSED_OP(Pointwise, kCpuProvider, PointwiseKernel, create_kernel, compute);

}  // namespace
}  // namespace onnxfuse
