// Generated from onnxfuse/ops (python -m onnxfuse.ops.header): do not edit.
//
// The fused ops of the onnxfuse domain, one struct each: the name and the signature every
// registration of the op declares. tests/test_ops_table.py checks this file against the
// table and the built library's registrations against both.
#pragma once

namespace onnxfuse {
namespace fused_ops {

// Pointwise: a region of elementwise ops as one expression program (onnxfuse/ops/pointwise.py)
struct Pointwise {
  static constexpr char kName[] = "Pointwise";
  static constexpr int kInputs = 1;  // declared input ports
  static constexpr int kRequiredInputs = 1;
  static constexpr int kVariadicMinInputs = 1;  // 0: not variadic
  static constexpr int kOutputs = 1;
  static constexpr int kRequiredOutputs = 1;
  static constexpr int kVariadicMinOutputs = 1;
  static constexpr int kHomogeneous = 0;  // 1: float32 tensors; 0: any element type
  static constexpr bool kCpu = true;
  static constexpr bool kCuda = true;
};

// ConvBiasAct: Conv + bias + activation (+ residual) on CUDA; onnxruntime fuses it on the CPU (onnxfuse/ops/conv_bias_act.py)
struct ConvBiasAct {
  static constexpr char kName[] = "ConvBiasAct";
  static constexpr int kInputs = 4;  // declared input ports
  static constexpr int kRequiredInputs = 3;
  static constexpr int kVariadicMinInputs = 0;  // 0: not variadic
  static constexpr int kOutputs = 1;
  static constexpr int kRequiredOutputs = 1;
  static constexpr int kVariadicMinOutputs = 0;
  static constexpr int kHomogeneous = 1;  // 1: float32 tensors; 0: any element type
  static constexpr bool kCpu = false;
  static constexpr bool kCuda = true;
};

// Attention: softmax(Q K^T * scale + bias) V, with masks, scale forms and head layouts (onnxfuse/ops/attention.py)
struct Attention {
  static constexpr char kName[] = "Attention";
  static constexpr int kInputs = 1;  // declared input ports
  static constexpr int kRequiredInputs = 1;
  static constexpr int kVariadicMinInputs = 1;  // 0: not variadic
  static constexpr int kOutputs = 1;
  static constexpr int kRequiredOutputs = 1;
  static constexpr int kVariadicMinOutputs = 0;
  static constexpr int kHomogeneous = 1;  // 1: float32 tensors; 0: any element type
  static constexpr bool kCpu = true;
  static constexpr bool kCuda = true;
};

// ChannelShuffle: Concat -> Reshape -> Transpose -> Reshape -> Split as one plane copy (onnxfuse/ops/channel_shuffle.py)
struct ChannelShuffle {
  static constexpr char kName[] = "ChannelShuffle";
  static constexpr int kInputs = 1;  // declared input ports
  static constexpr int kRequiredInputs = 1;
  static constexpr int kVariadicMinInputs = 1;  // 0: not variadic
  static constexpr int kOutputs = 1;
  static constexpr int kRequiredOutputs = 1;
  static constexpr int kVariadicMinOutputs = 1;
  static constexpr int kHomogeneous = 1;  // 1: float32 tensors; 0: any element type
  static constexpr bool kCpu = true;
  static constexpr bool kCuda = true;
};

// SqueezeExcite: global pool, two 1x1 convs with activations, gate, scale (onnxfuse/ops/squeeze_excite.py)
struct SqueezeExcite {
  static constexpr char kName[] = "SqueezeExcite";
  static constexpr int kInputs = 1;  // declared input ports
  static constexpr int kRequiredInputs = 1;
  static constexpr int kVariadicMinInputs = 5;  // 0: not variadic
  static constexpr int kOutputs = 1;
  static constexpr int kRequiredOutputs = 1;
  static constexpr int kVariadicMinOutputs = 0;
  static constexpr int kHomogeneous = 1;  // 1: float32 tensors; 0: any element type
  static constexpr bool kCpu = true;
  static constexpr bool kCuda = true;
};

// StackedMLP: K small MLPs on one input as one batched kernel (onnxfuse/ops/stacked_mlp.py)
struct StackedMLP {
  static constexpr char kName[] = "StackedMLP";
  static constexpr int kInputs = 1;  // declared input ports
  static constexpr int kRequiredInputs = 1;
  static constexpr int kVariadicMinInputs = 3;  // 0: not variadic
  static constexpr int kOutputs = 1;
  static constexpr int kRequiredOutputs = 1;
  static constexpr int kVariadicMinOutputs = 0;
  static constexpr int kHomogeneous = 1;  // 1: float32 tensors; 0: any element type
  static constexpr bool kCpu = true;
  static constexpr bool kCuda = false;
};

}  // namespace fused_ops
}  // namespace onnxfuse
