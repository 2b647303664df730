// The Pointwise expression program (onnxfuse/program.py) in C++, and its run-time plan.
//
// Shared by every Pointwise kernel (CPU here, CUDA in kernels/cuda_*.cc):
//  * Program::parse reads the text format of the node's `program` attribute once, at kernel
//    creation, and checks it as strictly as the Python parser does.
//  * resolve_plan turns the actual input shapes of one run into the iteration space: the output
//    shape (multidirectional broadcast of the inputs after their views), and for each input an
//    element offset and per-dimension element strides in that space (0 where broadcast, scaled and
//    possibly negative where viewed through a slice), with dimensions collapsed where every
//    operand allows it. Outputs are always dense and row-major over the iteration space.
//
// Node contract (both execution providers): op `Pointwise` in domain `onnxfuse`, variadic
// heterogeneous inputs and outputs (at least one each), string attribute `program`. Other
// attributes are reserved for specific execution providers (for example `cuda_ptx`,
// `cuda_entry` for the CUDA kernel) and are ignored by kernels that do not use them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernel_util.h"
#include "ort_api.h"

namespace onnxfuse {

constexpr const char* kProgramAttr = "program";

enum class DType : uint8_t { F16, BF16, F32, F64, Bool };

const char* dtype_name(DType d);
ONNXTensorElementDataType dtype_to_onnx(DType d);
size_t dtype_size(DType d);

// Opcodes, in the order of program.OPS.
#define ONNXFUSE_POINTWISE_OPS(X)                                                                      \
  X(Neg, "neg", 1, 0, false) X(Abs, "abs", 1, 0, false) X(Sqrt, "sqrt", 1, 0, false)                  \
  X(Recip, "recip", 1, 0, false) X(Exp, "exp", 1, 0, false) X(Log, "log", 1, 0, false)                \
  X(Erf, "erf", 1, 0, false) X(Tanh, "tanh", 1, 0, false) X(Sigmoid, "sigmoid", 1, 0, false)          \
  X(Relu, "relu", 1, 0, false) X(Softplus, "softplus", 1, 0, false)                                   \
  X(Softsign, "softsign", 1, 0, false) X(Floor, "floor", 1, 0, false) X(Ceil, "ceil", 1, 0, false)    \
  X(Round, "round", 1, 0, false) X(Sign, "sign", 1, 0, false) X(Sin, "sin", 1, 0, false)              \
  X(Cos, "cos", 1, 0, false) X(Tan, "tan", 1, 0, false) X(Asin, "asin", 1, 0, false)                  \
  X(Acos, "acos", 1, 0, false) X(Atan, "atan", 1, 0, false) X(Sinh, "sinh", 1, 0, false)              \
  X(Cosh, "cosh", 1, 0, false) X(Asinh, "asinh", 1, 0, false) X(Acosh, "acosh", 1, 0, false)          \
  X(Atanh, "atanh", 1, 0, false) X(HardSwish, "hardswish", 1, 0, false) X(Not, "not", 1, 0, true)     \
  X(IsNaN, "isnan", 1, 0, true) X(LeakyRelu, "leakyrelu", 1, 1, false) X(Elu, "elu", 1, 1, false)     \
  X(Selu, "selu", 1, 2, false) X(Celu, "celu", 1, 1, false) X(HardSigmoid, "hardsigmoid", 1, 2, false) \
  X(ThresholdedRelu, "thresholdedrelu", 1, 1, false) X(Clip, "clip", 1, 2, false)                     \
  X(Cast, "cast", 1, 1, false) X(Add, "add", 2, 0, false) X(Sub, "sub", 2, 0, false)                  \
  X(Mul, "mul", 2, 0, false) X(Div, "div", 2, 0, false) X(Pow, "pow", 2, 0, false)                    \
  X(Min, "min", 2, 0, false) X(Max, "max", 2, 0, false) X(PRelu, "prelu", 2, 0, false)                \
  X(Eq, "eq", 2, 0, true) X(Lt, "lt", 2, 0, true) X(Le, "le", 2, 0, true) X(Gt, "gt", 2, 0, true)     \
  X(Ge, "ge", 2, 0, true) X(And, "and", 2, 0, true) X(Or, "or", 2, 0, true) X(Xor, "xor", 2, 0, true) \
  X(Where, "where", 3, 0, false)

enum class Op : uint8_t {
#define ONNXFUSE_OP_ENUM(id, name, arity, nparams, pred) id,
  ONNXFUSE_POINTWISE_OPS(ONNXFUSE_OP_ENUM)
#undef ONNXFUSE_OP_ENUM
};

struct OpInfo {
  const char* name;
  int arity;
  int nparams;  // cast: 1, a dtype
  bool predicate;
};
const OpInfo& op_info(Op op);
int op_count();

// ONNX Slice along one axis, resolved against the run-time shape.
struct SliceSpec {
  int64_t axis, start, end, step;
};

// An instruction operand: an earlier value (input k is value k, instruction j is value
// num_inputs + j) or a literal.
struct Operand {
  bool is_literal = false;
  int value = -1;
  double literal = 0.0;
};

struct ProgramInput {
  DType dtype;
  std::vector<SliceSpec> view;
};

struct Instr {
  Op op;
  Operand args[3];
  double params[2] = {0.0, 0.0};
  DType cast_to = DType::F32;  // cast only
};

struct ProgramOutput {
  int value;  // value index, as in Operand
  DType dtype;
};

struct Program {
  std::vector<ProgramInput> inputs;
  std::vector<Instr> instrs;
  std::vector<ProgramOutput> outputs;
  // F64 when any input, output or cast is f64, F32 otherwise (program.Program.compute_dtype).
  DType compute = DType::F32;

  int num_values() const { return static_cast<int>(inputs.size() + instrs.size()); }

  // Parses the text format. On error returns false and sets *error to one line naming the
  // program line and what is wrong with it.
  static bool parse(const std::string& text, Program* out, std::string* error);
};

// Where one input's element of iteration index (i0, ..., i_{r-1}) lives:
// data + (offset + sum_d i_d * strides[d]) * element size.
struct InputLayout {
  int64_t offset = 0;
  std::vector<int64_t> strides;  // one per collapsed iteration dimension
};

struct IterPlan {
  std::vector<int64_t> out_shape;  // shape of every output tensor
  std::vector<int64_t> shape;      // collapsed iteration shape, at least one dimension
  std::vector<InputLayout> inputs;
  int64_t numel = 0;
};

// Resolves views and broadcasting for input tensors of the given shapes. Returns false with a
// one-line *error when the shapes do not fit the program (view axis out of range, shapes that
// do not broadcast).
bool resolve_plan(const Program& program, const std::vector<std::vector<int64_t>>& input_shapes, IterPlan* plan,
                  std::string* error);

}  // namespace onnxfuse
