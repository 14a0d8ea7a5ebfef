#!/usr/bin/env bash
# Issue 16's GPU checks and measurements (CUDA-graph capture of the AMP step), in one call on the
# GPU machine:
#   1. tests/cuda_capture.rs: captured = eager bit for bit (FusedSgd, FusedAdam(W), FusedLamb at
#      O0-O3 with f16 and bf16, planted overflows, an lr set every step), no host sync and no
#      allocation per replay, refusals naming the op, stale graphs, train_resnet captured/resumed;
#   2. benches/capture_speed.rs: images/s of the eager vs the captured step on the main job's
#      net (batch 128), the CIFAR ResNet-18 (batch 128) and ResNet-50 (batch 256), synthetic data,
#      each in NCHW and channels_last;
#   3. PyTorch on the same nets and layouts: eager, torch.compile(mode="reduce-overhead"),
#      hand-captured step;
#   4. the main job itself (train_resnet, no options, full Fashion-MNIST, 10 epochs): captured
#      (the default) vs --no-cuda-graph.
# Stage here:  scripts/gpu-stage --data --example train_resnet --bench capture_speed
# Run there:   bash benches/gpu_capture.sh [tests] [bench] [torch] [main]   (default: all four;
#              each part fits one 10-minute device call on its own; logs go under $OUT)
set -u
parts=${*:-tests bench torch main}
want() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mixprec-capture}
mkdir -p "$out"
export FASHION_MNIST_DIR=$PWD/.gpu/fashion-mnist MIXPREC_TEST_CUDA=1 RUST_BACKTRACE=1
bin=.gpu/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'

if want tests; then
echo "== 1. GPU tests (tests/cuda_capture.rs)"
$bin/test-cuda_capture --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$out/cuda_capture.log" \
  | grep -E "^test |^test result|bitwise|DIFFERENT|NONDETERMINISTIC|refused|replayed steps|panicked|train_resnet|stale"
fi

if want bench; then
echo "== 2. mixprec: eager vs captured step"
$bin/bench-capture_speed 2>&1 | tee "$out/capture_speed.log"
fi

if want torch; then
echo "== 3. PyTorch: eager, reduce-overhead, hand-captured"
for layout in nchw cl; do
  python3 benches/torch_capture_speed.py --layout $layout 2>&1 | tee -a "$out/torch_capture_speed.log"
done
fi

want main || exit 0
echo "== 4. the main job: captured (default) vs --no-cuda-graph"
for mode in captured eager; do
  flag=""; [ $mode = eager ] && flag="--no-cuda-graph"
  $bin/train_resnet --out "$out/main-$mode" --progress off $flag 2>&1 | tee "$out/main_$mode.log" \
    | grep -E "^(data|model|amp|step|epoch)"
done
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
def rates(mode):
    r = [float(m.group(1)) for m in re.finditer(r"(\d+) images/s", open(f"{out}/main_{mode}.log").read())]
    return r[1:] or r  # epoch 1 includes the warm-up and the capture
c, e = rates("captured"), rates("eager")
if c and e:
    mc, me = sorted(c)[len(c) // 2], sorted(e)[len(e) // 2]
    print(f"main job: median epoch images/s captured {mc:.0f}, eager {me:.0f}: {mc / me:.2f}x (target 2x)")
PY
# Keep what comes back small.
rm -rf "$out"/main-*/checkpoints "$out"/main-*/model.safetensors
