// The CPU Pointwise executor: a blocked virtual machine over the expression program.
//
// The iteration space (pointwise_plan.h) is cut into blocks of at most kBlock elements. For each
// block every instruction runs as one tight loop over contiguous registers of the compute type
// (numexpr's model): intermediates stay in L1, loops vectorize, dispatch costs once per block.
// Inputs are read in place when they are already contiguous in the compute type, as a scalar
// when constant over the block (broadcast), and converted into a register otherwise. Results
// that are outputs of the compute type are written straight into the output tensor. The AVX2
// build runs some float32 instruction runs (FusedStep) as one loop instead.
//
// Blocks are grouped into tasks run on onnxruntime's intra-op thread pool through
// KernelContext_ParallelFor; each thread keeps its registers in thread-local scratch memory.
#pragma once

#include <cstdint>
#include <vector>

#include "pointwise_plan.h"

namespace onnxfuse {

constexpr int64_t kBlock = 1024;            // elements per register block
constexpr int64_t kTaskElements = 1 << 15;  // elements per parallel task (amortizes scheduling)

// A run of consecutive instructions of a float32 program that the AVX2 build evaluates in one
// pass over the block, each vector kept in a register from the first instruction to the last:
// up to kMaxAffine affine stages (add, sub or mul of the running value and one other operand),
// then optionally one of the unary functions that build vectorizes (fusable_unary), then up to
// kMaxAffine more affine stages. Every result but the last is read only by the next instruction
// of the run and is no output, so it needs no register. The baseline build runs the instructions
// one at a time.
constexpr int kMaxAffine = 2;

struct AffineStage {
  enum Kind : uint8_t { Add, Sub, RSub, Mul };  // x + o, x - o, o - x, x * o for running value x
  Kind kind;
  int instr;  // the instruction it evaluates
  int other;  // which argument of that instruction is the other operand
};

struct FusedStep {
  int first = 0, count = 0;  // instructions [first, first + count)
  int input_arg = 0;         // the argument of instruction `first` that is the running value
  int num_pre = 0, num_post = 0;
  bool has_unary = false;
  Op unary = Op::Exp;
  AffineStage stages[2 * kMaxAffine];  // num_pre before the unary function, num_post after it
};

// The unary opcodes a FusedStep may hold.
bool fusable_unary(Op op);

// A Program with registers assigned, built once per kernel.
struct CompiledProgram {
  Program program;
  // For each instruction: its register slot (reused once the value is dead).
  std::vector<int> slot;
  int num_slots = 0;
  // For each value: the output it is written into directly when that output has the compute
  // type, -1 otherwise.
  std::vector<int> direct_output;
  // Runs of two or more instructions evaluated in one pass (float32 programs only), and for each
  // instruction the index of the run it starts, -1 where none starts.
  std::vector<FusedStep> steps;
  std::vector<int> step_at;

  explicit CompiledProgram(Program p);

 private:
  void plan_fused_steps();
};

struct ExecInput {
  const unsigned char* data;
  DType dtype;
  int64_t offset;
  const int64_t* strides;  // per collapsed dimension
};

struct ExecOutput {
  unsigned char* data;
  DType dtype;
};

// One run of the program over one plan.
struct ExecJob {
  const CompiledProgram* prog;
  const int64_t* shape;  // collapsed iteration shape
  int rank;
  const ExecInput* inputs;
  const ExecOutput* outputs;
  // Block geometry over the collapsed shape: rows of length `inner`.
  int64_t inner = 0, rows = 0;
  int64_t chunks_per_row = 0, chunk = 0;  // inner >= kBlock: a block is a chunk of a row
  int64_t rows_per_block = 0;             // inner < kBlock: a block is whole rows
  int64_t num_blocks = 0;
  int64_t blocks_per_task = 1;
  int64_t num_tasks = 0;
};

void init_geometry(ExecJob* job);

// Runs blocks [task * blocks_per_task, ...) of the job; defined once per instruction set.
namespace isa_base {
void run_task(const ExecJob& job, int64_t task);
}
namespace isa_avx2 {
void run_task(const ExecJob& job, int64_t task);
}

// The best run_task this CPU supports.
using RunTaskFn = void (*)(const ExecJob&, int64_t);
RunTaskFn select_run_task();

}  // namespace onnxfuse
