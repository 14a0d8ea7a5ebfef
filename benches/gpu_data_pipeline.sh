#!/usr/bin/env bash
# Issue 20's GPU acceptance, in one call on the GPU machine (16 cores): the image training
# pipeline (decode, RandomResizedCrop(224), flip, normalise, batch 256, pinned upload) against
# torchvision's ImageFolder + DataLoader (16 workers, pin_memory) on the same generated folder
# of ImageNet-sized JPEGs, then the ResNet-50 O2 step fed by it against synthetic data.
# Stage here:  scripts/gpu-stage --no-tests --bench data_pipeline
# Run there:   bash benches/gpu_data_pipeline.sh      (the table is the last thing printed)
set -eu
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mixprec-data-pipeline}
data=${DATA:-/tmp/mixprec-imagefolder}
workers=${WORKERS:-16}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc
python3 -c 'import torch, torchvision, PIL; print("torch", torch.__version__, "torchvision", torchvision.__version__, "PIL", PIL.__version__)'
echo "== generating $data (10,000 JPEGs around 500x375, 100 classes)"
time python3 benches/make_imagefolder.py "$data" --images 10000 --classes 100 --workers "$workers"
du -sh "$data"
# Both pipelines read from the page cache.
find "$data" -type f -print0 | xargs -0 cat > /dev/null
echo "== torchvision"
python3 benches/torch_data_pipeline.py "$data" --batch 256 --workers "$workers" --batches 30 --json "$out/torch.json"
echo "== mixprec"
.gpu/bin/bench-data_pipeline --data "$data" --batch 256 --workers "$workers" --batches 30 --steps 25 \
  --torch-json "$out/torch.json" 2>&1 | tee "$out/mixprec.log"
