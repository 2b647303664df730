// Generated from onnxfuse/ops (python -m onnxfuse.ops.header): do not edit.
//
// The fused ops of the onnxfuse domain: the name and the signature every registration of
// each declares (kernel_util.h: fused_op). tests/test_ops_table.py checks this file against
// the table, and the built library's registrations against both.
#pragma once

namespace onnxfuse {

// Inputs, then outputs: ports, required ports, variadic minimum arity (0: not variadic)
// (onnxfuse/ops/contract.py: FusedOp.signature). Homogeneous: float32 tensors, otherwise
// any element type. cpu, cuda: the providers a kernel of ours is registered on.
struct FusedOpSignature {
  const char* name;
  int inputs, required_inputs, variadic_inputs;
  int outputs, required_outputs, variadic_outputs;
  bool homogeneous, cpu, cuda;
};

namespace fused_ops {

inline constexpr FusedOpSignature Pointwise{"Pointwise", 1, 1, 1, 1, 1, 1, false, true, true};  // ops/pointwise.py
inline constexpr FusedOpSignature ConvBiasAct{"ConvBiasAct", 4, 3, 0, 1, 1, 0, true, false, true};  // ops/conv_bias_act.py
inline constexpr FusedOpSignature Attention{"Attention", 1, 1, 1, 1, 1, 0, true, true, true};  // ops/attention.py
inline constexpr FusedOpSignature ChannelShuffle{"ChannelShuffle", 1, 1, 1, 1, 1, 1, true, true, true};  // ops/channel_shuffle.py
inline constexpr FusedOpSignature SqueezeExcite{"SqueezeExcite", 1, 1, 5, 1, 1, 0, true, true, true};  // ops/squeeze_excite.py
inline constexpr FusedOpSignature StackedMLP{"StackedMLP", 1, 1, 3, 1, 1, 0, true, true, false};  // ops/stacked_mlp.py
inline constexpr FusedOpSignature AttentionNanGuard{"AttentionNanGuard", 5, 2, 0, 1, 1, 0, true, true, false};  // ops/attention_nan_guard.py

}  // namespace fused_ops
}  // namespace onnxfuse
