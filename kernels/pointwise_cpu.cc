// onnxfuse.Pointwise for CPUExecutionProvider: kernel creation, run-time shape resolution,
// threading, and the baseline build of the block executor.
#include "pointwise_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "numeric.h"
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
}

void init_geometry(ExecJob* job) {
  job->inner = job->shape[job->rank - 1];
  int64_t numel = 1;
  for (int d = 0; d < job->rank; ++d) numel *= job->shape[d];
  job->rows = job->inner ? numel / job->inner : 0;
  if (job->inner >= kBlock) {
    job->chunks_per_row = (job->inner + kBlock - 1) / kBlock;
    job->chunk = (job->inner + job->chunks_per_row - 1) / job->chunks_per_row;
    job->num_blocks = job->rows * job->chunks_per_row;
    job->rows_per_block = 0;
  } else {
    job->chunks_per_row = 0;
    job->rows_per_block = job->inner ? kBlock / job->inner : 1;
    job->num_blocks = (job->rows + job->rows_per_block - 1) / job->rows_per_block;
  }
  job->blocks_per_task = std::max<int64_t>(1, kTaskElements / kBlock);
  job->num_tasks = (job->num_blocks + job->blocks_per_task - 1) / job->blocks_per_task;
}

RunTaskFn select_run_task() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && std::getenv("ONNXFUSE_NO_AVX2") == nullptr)
    return isa_avx2::run_task;
#endif
  return isa_base::run_task;
}

namespace {

struct PointwiseKernel {
  OrtApiRef api;
  CompiledProgram prog;
  std::string node_name;
  RunTaskFn run_task;
};

std::string node_label(const std::string& name) {
  return "onnxfuse Pointwise node '" + name + "': ";
}

// Turns a failed status from onnxruntime into one with our context prepended.
OrtStatus* wrap(const OrtApiRef& api, OrtStatus* st, const std::string& context) {
  std::string msg = context + api.GetErrorMessage(st);
  OrtErrorCode code = api.GetErrorCode(st);
  api.ReleaseStatus(st);
  return api.CreateStatus(code, msg.c_str());
}

#define ONNXFUSE_RETURN_IF(call, context)              \
  do {                                                  \
    if (OrtStatus* st_ = (call)) return wrap(api, st_, context); \
  } while (0)

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** kernel) noexcept {
  OrtApiRef api(raw);
  try {
    std::string name;
    size_t size = 0;
    ONNXFUSE_RETURN_IF(api.KernelInfo_GetNodeName(info, nullptr, &size), "onnxfuse Pointwise: ");
    name.resize(size);
    ONNXFUSE_RETURN_IF(api.KernelInfo_GetNodeName(info, name.data(), &size), "onnxfuse Pointwise: ");
    name.resize(std::strlen(name.c_str()));
    const std::string where = node_label(name);

    size = 0;
    ONNXFUSE_RETURN_IF(api.KernelInfoGetAttribute_string(info, kProgramAttr, nullptr, &size),
                       where + "string attribute 'program': ");
    std::string text(size, '\0');
    ONNXFUSE_RETURN_IF(api.KernelInfoGetAttribute_string(info, kProgramAttr, text.data(), &size), where);
    text.resize(std::strlen(text.c_str()));

    Program program;
    std::string error;
    if (!Program::parse(text, &program, &error))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());

    size_t n_in = 0, n_out = 0;
    ONNXFUSE_RETURN_IF(api.KernelInfo_GetInputCount(info, &n_in), where);
    ONNXFUSE_RETURN_IF(api.KernelInfo_GetOutputCount(info, &n_out), where);
    if (n_in != program.inputs.size() || n_out != program.outputs.size()) {
      std::string msg = where + "program declares " + std::to_string(program.inputs.size()) + " inputs and " +
                        std::to_string(program.outputs.size()) + " outputs, the node has " + std::to_string(n_in) +
                        " and " + std::to_string(n_out);
      return api.CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
    }
    *kernel = new PointwiseKernel{api, CompiledProgram(std::move(program)), name, select_run_task()};
    return nullptr;
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, "onnxfuse Pointwise: out of memory");
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (std::string("onnxfuse Pointwise: ") + e.what()).c_str());
  }
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

OrtStatus* compute(void* kernel_ptr, OrtKernelContext* ctx) noexcept {
  auto* kernel = static_cast<PointwiseKernel*>(kernel_ptr);
  const OrtApiRef& api = kernel->api;
  const Program& prog = kernel->prog.program;
  const std::string where = node_label(kernel->node_name);
  try {
    size_t n_in = 0, n_out = 0;
    ONNXFUSE_RETURN_IF(api.KernelContext_GetInputCount(ctx, &n_in), where);
    ONNXFUSE_RETURN_IF(api.KernelContext_GetOutputCount(ctx, &n_out), where);
    if (n_in != prog.inputs.size() || n_out != prog.outputs.size())
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "input/output count differs from the program").c_str());

    std::vector<std::vector<int64_t>> shapes(n_in);
    std::vector<ExecInput> inputs(n_in);
    for (size_t i = 0; i < n_in; ++i) {
      const OrtValue* value = nullptr;
      ONNXFUSE_RETURN_IF(api.KernelContext_GetInput(ctx, i, &value), where);
      if (value == nullptr)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "input " + std::to_string(i) + " is missing").c_str());
      OrtTensorTypeAndShapeInfo* ti = nullptr;
      ONNXFUSE_RETURN_IF(api.GetTensorTypeAndShape(value, &ti), where);
      ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      size_t rank = 0;
      OrtStatus* st = api.GetTensorElementType(ti, &et);
      if (!st) st = api.GetDimensionsCount(ti, &rank);
      if (!st) {
        shapes[i].resize(rank);
        st = api.GetDimensions(ti, shapes[i].data(), rank);
      }
      api.ReleaseTensorTypeAndShapeInfo(ti);
      if (st) return wrap(api, st, where);
      if (et != dtype_to_onnx(prog.inputs[i].dtype)) {
        std::string msg = where + "input " + std::to_string(i) + " is " + type_name(et) + ", the program reads " +
                          dtype_name(prog.inputs[i].dtype);
        return api.CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
      }
      void* data = nullptr;
      ONNXFUSE_RETURN_IF(api.GetTensorMutableData(const_cast<OrtValue*>(value), &data), where);
      inputs[i].data = static_cast<const unsigned char*>(data);
      inputs[i].dtype = prog.inputs[i].dtype;
    }

    IterPlan plan;
    std::string error;
    if (!resolve_plan(prog, shapes, &plan, &error))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());
    for (size_t i = 0; i < n_in; ++i) {
      inputs[i].offset = plan.inputs[i].offset;
      inputs[i].strides = plan.inputs[i].strides.data();
    }

    std::vector<ExecOutput> outputs(n_out);
    for (size_t o = 0; o < n_out; ++o) {
      OrtValue* value = nullptr;
      ONNXFUSE_RETURN_IF(
          api.KernelContext_GetOutput(ctx, o, plan.out_shape.data(), plan.out_shape.size(), &value), where);
      if (value == nullptr) continue;  // an output nobody reads
      OrtTensorTypeAndShapeInfo* ti = nullptr;
      ONNXFUSE_RETURN_IF(api.GetTensorTypeAndShape(value, &ti), where);
      ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      OrtStatus* st = api.GetTensorElementType(ti, &et);
      api.ReleaseTensorTypeAndShapeInfo(ti);
      if (st) return wrap(api, st, where);
      if (et != dtype_to_onnx(prog.outputs[o].dtype)) {
        std::string msg = where + "output " + std::to_string(o) + " is " + type_name(et) +
                          ", the program writes " + dtype_name(prog.outputs[o].dtype);
        return api.CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
      }
      void* data = nullptr;
      ONNXFUSE_RETURN_IF(api.GetTensorMutableData(value, &data), where);
      outputs[o].data = static_cast<unsigned char*>(data);
      outputs[o].dtype = prog.outputs[o].dtype;
    }
    if (plan.numel == 0) return nullptr;

    // Outputs onnxruntime did not allocate (unused optional results) get a throwaway buffer, so
    // the executor never branches on them.
    std::vector<std::vector<unsigned char>> discard;
    for (size_t o = 0; o < n_out; ++o) {
      if (outputs[o].data) continue;
      discard.emplace_back(static_cast<size_t>(plan.numel) * dtype_size(prog.outputs[o].dtype));
      outputs[o].data = discard.back().data();
      outputs[o].dtype = prog.outputs[o].dtype;
    }

    ExecJob job;
    job.prog = &kernel->prog;
    job.shape = plan.shape.data();
    job.rank = static_cast<int>(plan.shape.size());
    job.inputs = inputs.data();
    job.outputs = outputs.data();
    init_geometry(&job);

    if (job.num_tasks == 1) {
      kernel->run_task(job, 0);
      return nullptr;
    }
    ParallelRun pr;
    pr.job = &job;
    pr.run_task = kernel->run_task;
    ONNXFUSE_RETURN_IF(
        api.KernelContext_ParallelFor(ctx, run_one_task, static_cast<size_t>(job.num_tasks), 0, &pr), where);
    if (pr.failed.load()) return api.CreateStatus(ORT_FAIL, (where + "out of memory").c_str());
    return nullptr;
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, (where + "out of memory").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (where + e.what()).c_str());
  }
}

void destroy_kernel(void* kernel) { delete static_cast<PointwiseKernel*>(kernel); }

const char* op_name(const OrtCustomOp*) { return kPointwiseOpName; }
const char* cpu_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType any_type(const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
size_t one(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic variadic(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; }
OrtMemType default_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int min_inputs(const OrtCustomOp*) { return kPointwiseMinInputs; }
int min_outputs(const OrtCustomOp*) { return kPointwiseMinOutputs; }
int heterogeneous(const OrtCustomOp*) { return 0; }

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = kOrtApiVersion;
  op.GetName = op_name;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputType = any_type;
  op.GetInputTypeCount = one;
  op.GetOutputType = any_type;
  op.GetOutputTypeCount = one;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = variadic;
  op.GetOutputCharacteristic = variadic;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = min_inputs;
  op.GetVariadicInputHomogeneity = heterogeneous;
  op.GetVariadicOutputMinArity = min_outputs;
  op.GetVariadicOutputHomogeneity = heterogeneous;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

OrtCustomOp pointwise_cpu_op = make_op();
ONNXFUSE_REGISTER_OP(pointwise_cpu_op);

}  // namespace
}  // namespace onnxfuse
