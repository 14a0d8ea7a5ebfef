#!/usr/bin/env bash
# The main job's GPU measurements, in one call on the GPU machine (issue 6's acceptance):
#   1. train_resnet with configs/run_fashion_mnist_full.toml on the full Fashion-MNIST, then the
#      same net, data and schedule in PyTorch (autocast f16 + GradScaler), side by side;
#   2. train_resnet with no options (the README's command) on the same data;
#   3. torchvision's resnet18 weights exported by PyTorch there, loaded by mixprec, same logits
#      (CPU and GPU).
# Stage here:  scripts/gpu-stage --data --no-tests --example train_resnet --example torchvision_logits
# Run there:   bash benches/gpu_main_job.sh     (logs and outputs go under $OUT)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mixprec-main-job}
mkdir -p "$out"
export FASHION_MNIST_DIR=$PWD/.gpu/fashion-mnist
bin=.gpu/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'

echo "== 1. full config: mixprec"
$bin/train_resnet --config configs/run_fashion_mnist_full.toml --out "$out/full" --progress lines 2>&1 \
  | grep -Ev "^epoch +[0-9]+/[0-9]+: " | tee "$out/mixprec_full.log"
echo "== 1. full config: PyTorch"
python3 benches/torch_train_fashion_mnist.py --data "$FASHION_MNIST_DIR" --epochs 15 \
  --widths 32,64,128 --blocks 2,2,2 --batch-size 128 --lr 0.1 --warmup-fraction 0.25 --augment 2>&1 \
  | tee "$out/torch_full.log"

echo "== 2. defaults (no options)"
$bin/train_resnet --out "$out/default" --progress off 2>&1 | tee "$out/mixprec_default.log"
echo "== 2. defaults: PyTorch"
python3 benches/torch_train_fashion_mnist.py --data "$FASHION_MNIST_DIR" --epochs 10 \
  --widths 16,32,64 --blocks 1,1,1 --batch-size 128 --lr 0.1 --warmup-fraction 0.25 2>&1 \
  | tee "$out/torch_default.log"

echo "== 3. torchvision resnet18 weights -> mixprec logits"
python3 benches/torchvision_interop.py "$out/tv" 2>&1 | tail -3
for d in cpu cuda; do
  $bin/torchvision_logits --weights "$out/tv/resnet18.safetensors" --io "$out/tv/resnet18_io.safetensors" --device $d 2>&1 | tail -4
done
# Keep what comes back small: logs, metrics and plots.
rm -rf "$out/tv" "$out"/*/checkpoints "$out"/*/model.safetensors
