#!/usr/bin/env bash
# On the GPU host, after `bash gpu/run.sh setup`: what the ConvBiasAct policy needs measured for
# split-K (clusters) and the 3xTF32 tensor-core GEMM, both opt-in until these figures exist.
#
#   bash gpu/conv_eval.sh tests    pytest -m gpu on the conv kernels (every candidate tile on the
#                                  GPU vs onnxruntime, split-K in a session and in a CUDA graph)
#   bash gpu/conv_eval.sh sweep    kernel-only time of every candidate tile per resnet50 and
#                                  mobilenetv3 layer, next to cuDNN (python -m bench.conv_cuda_sweep)
#   bash gpu/conv_eval.sh layers   per-layer session table, heuristic tiles with --split-k
#                                  --tensor-cores, against onnxruntime's Conv (python -m bench.conv_cuda_layers)
#   bash gpu/conv_eval.sh e2e      resnet50 and mobilenetv3 end to end (python -m bench.gpu): default
#                                  policy, and every layer fused with split-K + tensor cores
# Each part takes a few minutes; results go to bench/results/conv_cuda_*.{md,json}.
set -euo pipefail
part=${1:?usage: gpu/conv_eval.sh tests|sweep|layers|e2e}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
venv=${ONNXFUSE_VENV:-$repo/.gpu-venv}
py=$venv/bin/python
# shellcheck disable=SC1091
. "$venv/env.sh"
export PYTHONUNBUFFERED=1
results=bench/results
env_md=$venv/env.md
env_opt=()
[ -f "$env_md" ] && env_opt=(--env "$env_md")
case "$part" in
  tests)
    "$py" -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_cuda_conv.py tests/gpu/test_cuda_ort.py \
        -k "conv or kernel_on_gpu or tune or split" 2>&1 | tee "$venv/work/conv-tests.txt"
    { echo "# ConvBiasAct GPU tests"; echo; cat "$env_md" 2>/dev/null; echo; echo '```';
      tail -40 "$venv/work/conv-tests.txt"; echo '```'; } | sed "s#$repo/##g" > $results/conv_cuda_gpu_tests.md ;;
  sweep)
    "$py" -m bench.conv_cuda_sweep --models resnet50,mobilenetv3 --reps 30 \
        --md $results/conv_cuda_sweep.md --json $results/conv_cuda_sweep.json ;;
  layers)
    "$py" -m bench.conv_cuda_layers --models resnet50,mobilenetv3 --split-k --tensor-cores --runs 100 \
        --budget 480 "${env_opt[@]}" \
        --md $results/conv_cuda_layers_splitk_tc.md --json $results/conv_cuda_layers_splitk_tc.json ;;
  e2e)
    "$py" -m bench.gpu --models resnet50,mobilenetv3 "${env_opt[@]}" \
        --md $results/gpu_bench_conv_default.md --json $results/gpu_bench_conv_default.json
    "$py" -m bench.gpu --models resnet50,mobilenetv3 "${env_opt[@]}" --conv-policy always --split-k --tensor-cores \
        --md $results/gpu_bench_conv_always_splitk_tc.md --json $results/gpu_bench_conv_always_splitk_tc.json ;;
  *) echo "usage: gpu/conv_eval.sh tests|sweep|layers|e2e" >&2; exit 2 ;;
esac
