/* Run an onnxfuse-optimized char_rnn model with onnxruntime's C API, on onnxfuse's kernels.
 *
 *   run_char_rnn MODEL.onnx [LIBRARY.so]
 *
 * LIBRARY.so is onnxfuse's custom-op library (`onnxfuse info` prints its path); without it,
 * onnxruntime runs the fused nodes' fallback functions. Prints the 65 logits, one per line.
 * Build and link: docs/deploy.md. Exit status 0, or 1 with onnxruntime's message on stderr. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "onnxruntime_c_api.h"

static const OrtApi* ort;

/* Every C API call returns NULL or an OrtStatus* to read and release. */
static void check(OrtStatus* status, const char* what) {
  if (status != NULL) {
    fprintf(stderr, "run_char_rnn: %s: %s\n", what, ort->GetErrorMessage(status));
    ort->ReleaseStatus(status);
    exit(1);
  }
}

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s MODEL.onnx [LIBRARY.so]\n", argv[0]);
    return 2;
  }
  /* ORT_API_VERSION is the headers' version: any onnxruntime at least as new serves it. */
  ort = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  if (ort == NULL) {
    fprintf(stderr, "run_char_rnn: this onnxruntime (%s) is older than the headers (API %d)\n",
            OrtGetApiBase()->GetVersionString(), ORT_API_VERSION);
    return 1;
  }

  OrtEnv* env;
  check(ort->CreateEnv(ORT_LOGGING_LEVEL_WARNING, "run_char_rnn", &env), "CreateEnv");
  OrtSessionOptions* options;
  check(ort->CreateSessionOptions(&options), "CreateSessionOptions");
  if (argc == 3) {
    check(ort->RegisterCustomOpsLibrary_V2(options, argv[2]), "RegisterCustomOpsLibrary_V2");
  }
  OrtSession* session;
  check(ort->CreateSession(env, argv[1], options, &session), "CreateSession");

  /* Inputs: 16 tokens and zero states of the two LSTM layers. */
  int64_t tokens[16];
  for (int i = 0; i < 16; ++i) tokens[i] = i;
  static float state[4][128]; /* zeros */
  const int64_t tokens_shape[2] = {1, 16}, state_shape[2] = {1, 128};

  OrtMemoryInfo* cpu;
  check(ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &cpu), "CreateCpuMemoryInfo");
  OrtValue* inputs[5] = {NULL};
  check(ort->CreateTensorWithDataAsOrtValue(cpu, tokens, sizeof tokens, tokens_shape, 2,
                                            ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, &inputs[0]),
        "CreateTensorWithDataAsOrtValue");
  for (int i = 0; i < 4; ++i) {
    check(ort->CreateTensorWithDataAsOrtValue(cpu, state[i], sizeof state[i], state_shape, 2,
                                              ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &inputs[1 + i]),
          "CreateTensorWithDataAsOrtValue");
  }
  const char* input_names[5] = {"tokens", "h0.0", "c0.0", "h0.1", "c0.1"};
  const char* output_names[1] = {"logits"};
  OrtValue* logits = NULL;
  check(ort->Run(session, NULL, input_names, (const OrtValue* const*)inputs, 5, output_names, 1, &logits), "Run");

  float* values;
  check(ort->GetTensorMutableData(logits, (void**)&values), "GetTensorMutableData");
  OrtTensorTypeAndShapeInfo* info;
  check(ort->GetTensorTypeAndShape(logits, &info), "GetTensorTypeAndShape");
  size_t count;
  check(ort->GetTensorShapeElementCount(info, &count), "GetTensorShapeElementCount");
  for (size_t i = 0; i < count; ++i) printf("%.9g\n", values[i]);

  ort->ReleaseTensorTypeAndShapeInfo(info);
  ort->ReleaseValue(logits);
  for (int i = 0; i < 5; ++i) ort->ReleaseValue(inputs[i]);
  ort->ReleaseMemoryInfo(cpu);
  ort->ReleaseSession(session);
  ort->ReleaseSessionOptions(options);
  ort->ReleaseEnv(env);
  return 0;
}
