// The CPU Pointwise executor: a blocked virtual machine over the expression program.
//
// The iteration space (pointwise_plan.h) is cut into blocks of at most kBlock elements (of
// kStreamBlock, one per task, for a streaming job: see there). For each block every instruction
// runs as one tight loop over contiguous registers of the compute type (numexpr's model):
// intermediates stay in L1, loops vectorize, dispatch costs once per block.
// Inputs are read in place when they are already contiguous in the compute type, as a scalar
// when constant over the block (broadcast), and converted into a register otherwise. Results
// that are outputs of the compute type are written straight into the output tensor. The AVX2
// build runs float32 instruction chains (FusedStep) as one loop instead.
//
// Blocks are grouped into tasks run on onnxruntime's intra-op thread pool through
// KernelContext_ParallelFor; each thread keeps its registers in thread-local scratch memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pointwise_plan.h"

namespace onnxfuse {

constexpr int64_t kBlock = 1024;            // elements per register block
constexpr int64_t kTaskElements = 1 << 15;  // elements per parallel task (amortizes scheduling)
// Elements per block of a streaming job: one whose program keeps no value in a register (every
// instruction's result goes to the next one inside a chain, or straight to an output) and whose
// inputs are all read in place or as a scalar per block, so a block touches no scratch memory
// and can be as long as a task. What a block costs to set up (its inputs' addresses, each chain's
// stages and constants) then comes once per task instead of once per short block, where it was a
// measurable part of the time (bench/results/cpu_kernel_design.md).
constexpr int64_t kStreamBlock = kTaskElements;

// A run of consecutive instructions of a float32 program that the AVX2 build evaluates without a
// pass over memory per instruction (a chain): it runs the chain in segments (ChainSegment below),
// each of which loads its vectors once, carries them in registers through its instructions and
// stores them once (between segments, into a tile buffer that stays in L1). Each instruction is a
// stage: a unary opcode of the running value, or a binary one of the running value and one other
// operand (a literal or a value with a register); chain_op says which opcodes. Every result but
// the last is read only by the next instruction of the run and is no output, so it needs no
// register. Each stage is the same single IEEE operation (or the same elementary function) as the
// instruction it replaces, so results are the bits of one instruction at a time. The baseline
// build runs the instructions one at a time.
constexpr int kMaxChain = 32;

struct ChainStage {
  // x is the running value, o the other operand; R* kinds have the running value second.
  enum Kind : uint8_t {
    Add, Sub, RSub, Mul, Div, RDiv, Max, RMax, Min, RMin,  // binary
    MaxC, MinC,  // MAXPS/MINPS(o, x): what the executor runs Max/Min as for a constant o where exact
    Neg, Abs, Relu, Sqrt, Recip, Floor, Ceil, Round,       // unary, exact
    LeakyRelu, Clip,                                       // unary with parameters
    Exp, Log, Erf, Tanh, Sigmoid,                          // unary, elementary functions
  };
  Kind kind;
  int instr;  // the instruction it evaluates
  int other;  // the argument of that instruction that is the other operand; -1 for unary kinds
  float p0 = 0.0f, p1 = 0.0f;  // the instruction's parameters, in float32 (LeakyRelu, Clip)
};

// Whether a stage kind is one of the elementary functions, and whether it is add, sub or mul.
constexpr bool elementary_kind(ChainStage::Kind k) { return k >= ChainStage::Exp; }
constexpr bool affine_kind(ChainStage::Kind k) { return k <= ChainStage::Mul; }

// A part of a chain that the AVX2 build runs as one loop, several vectors at a time so that
// independent operations hide each step's latency: one elementary function with up to kMaxAffine
// add/sub/mul stages right before and after it, or a run of other stages.
constexpr int kMaxAffine = 2;
struct ChainSegment {
  int begin = 0, count = 0;  // stages [begin, begin + count) of the chain
  int pre = -1;              // stages before the elementary function; -1 when there is none
};

struct FusedStep {
  int first = 0, count = 0;  // instructions [first, first + count), one stage each
  int input_arg = 0;         // the argument of instruction `first` that is the running value
  int num_segments = 0;
  // The chain's `count` stages and `num_segments` segments, in the CompiledProgram's
  // chain_stages and chain_segments, where the steps' are stored back to back: a step plus its
  // stages is then a cache line or two, where arrays of kMaxChain each made it 1 KB and char_rnn's
  // 160 steps missed the cache on every call (bench/results/cpu_kernel_design.md).
  const ChainStage* stages = nullptr;
  const ChainSegment* segments = nullptr;
};

// Whether an opcode can be a stage of a chain.
bool chain_op(Op op);

// A Program with registers assigned, built once per kernel.
struct CompiledProgram {
  Program program;
  // For each instruction: its register slot (reused once the value is dead).
  std::vector<int> slot;
  int num_slots = 0;
  // For each value: the output it is written into directly when that output has the compute
  // type, -1 otherwise.
  std::vector<int> direct_output;
  // Chains of two or more instructions evaluated in one pass (float32 programs only), and for each
  // instruction the index of the run it starts, -1 where none starts.
  std::vector<FusedStep> steps;
  std::vector<int> step_at;
  std::vector<ChainStage> chain_stages;      // the steps' stages, back to back
  std::vector<ChainSegment> chain_segments;  // and their segments

  explicit CompiledProgram(Program p);
  // The steps point into chain_stages and chain_segments: a copy would point into the
  // original's (a move keeps the vectors' storage, so it may).
  CompiledProgram(const CompiledProgram&) = delete;
  CompiledProgram& operator=(const CompiledProgram&) = delete;
  CompiledProgram(CompiledProgram&&) = default;
  CompiledProgram& operator=(CompiledProgram&&) = default;

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
  bool streaming = false;                 // blocks of up to kStreamBlock elements (see there)
  int64_t block = kBlock;                 // elements per block at most: each register's length
  int64_t chunks_per_row = 0, chunk = 0;  // inner >= kBlock: a block is a chunk of a row
  int64_t rows_per_block = 0;             // inner < kBlock: a block is whole rows
  int64_t num_blocks = 0;
  int64_t blocks_per_task = 1;
  int64_t num_tasks = 0;
};

// Sets the block geometry of a job whose prog, shape, rank and `streaming` are set.
void init_geometry(ExecJob* job);

// Runs blocks [task * blocks_per_task, ...) of the job, and applies one unary float32
// instruction in place (pointwise_exec.inc); defined once per instruction set.
namespace isa_base {
void run_task(const ExecJob& job, int64_t task);
void apply_unary_f32(const Instr& ins, float* data, int64_t n);
}
namespace isa_avx2 {
void run_task(const ExecJob& job, int64_t task);
void apply_unary_f32(const Instr& ins, float* data, int64_t n);
}

// The best run_task and apply_unary_f32 this CPU supports.
using RunTaskFn = void (*)(const ExecJob&, int64_t);
RunTaskFn select_run_task();
using ApplyUnaryFn = void (*)(const Instr&, float*, int64_t);
ApplyUnaryFn select_apply_unary_f32();

// The instruction `t0 = SPEC x0` of a float32 program, for a kernel whose epilogue applies an
// activation named in program syntax (`relu`, `leakyrelu[0.01]`): false with *error when SPEC
// is not a unary op of the program that computes a value.
bool parse_unary_f32(const std::string& spec, Instr* out, std::string* error);

}  // namespace onnxfuse
