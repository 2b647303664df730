// Run an onnxfuse-optimized char_rnn model with onnxruntime's C++ API, on onnxfuse's kernels.
//
//   run_char_rnn_cpp MODEL.onnx [LIBRARY.so]
//
// LIBRARY.so is onnxfuse's custom-op library (`onnxfuse info` prints its path); without it,
// onnxruntime runs the fused nodes' fallback functions. Prints the 65 logits, one per line.
// Build and link: docs/deploy.md. Exit status 0, or 1 with onnxruntime's message on stderr.
#include <array>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "onnxruntime_cxx_api.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s MODEL.onnx [LIBRARY.so]\n", argv[0]);
    return 2;
  }
  try {
    Ort::Env env(ORT_LOGGING_LEVEL_WARNING, "run_char_rnn");
    Ort::SessionOptions options;
    if (argc == 3) options.RegisterCustomOpsLibrary(argv[2]);
    Ort::Session session(env, argv[1], options);

    // Inputs: 16 tokens and zero states of the two LSTM layers.
    std::array<int64_t, 16> tokens;
    for (int i = 0; i < 16; ++i) tokens[i] = i;
    std::array<std::array<float, 128>, 4> state{};
    const std::array<int64_t, 2> tokens_shape{1, 16}, state_shape{1, 128};

    auto cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    std::vector<Ort::Value> inputs;
    inputs.push_back(Ort::Value::CreateTensor<int64_t>(cpu, tokens.data(), tokens.size(), tokens_shape.data(), 2));
    for (auto& s : state) {
      inputs.push_back(Ort::Value::CreateTensor<float>(cpu, s.data(), s.size(), state_shape.data(), 2));
    }
    const char* input_names[] = {"tokens", "h0.0", "c0.0", "h0.1", "c0.1"};
    const char* output_names[] = {"logits"};
    auto outputs = session.Run(Ort::RunOptions{nullptr}, input_names, inputs.data(), inputs.size(), output_names, 1);

    const float* logits = outputs[0].GetTensorData<float>();
    size_t count = outputs[0].GetTensorTypeAndShapeInfo().GetElementCount();
    for (size_t i = 0; i < count; ++i) std::printf("%.9g\n", logits[i]);
  } catch (const Ort::Exception& e) {  // every failing call throws, with onnxruntime's message
    std::fprintf(stderr, "run_char_rnn: %s\n", e.what());
    return 1;
  }
  return 0;  // the Ort:: objects release themselves, in reverse order
}
