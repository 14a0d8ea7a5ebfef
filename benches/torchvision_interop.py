"""torchvision's ResNet-18 weights and logits for examples/torchvision_logits.rs.

    python3 benches/torchvision_interop.py OUT_DIR
    cargo run --release --example torchvision_logits -- \
        --weights OUT_DIR/resnet18.safetensors --io OUT_DIR/resnet18_io.safetensors [--device cuda]

Builds torchvision.models.resnet18(num_classes=1000) with torch's seed 0 (torchvision's own
initialisation), gives every BatchNorm random affine parameters and running statistics (so that
eval mode exercises them), and writes, in eval mode:
  OUT_DIR/resnet18.safetensors     the state dict (F32 and the I64 num_batches_tracked), as
                                   safetensors.torch.save_file writes it;
  OUT_DIR/resnet18_io.safetensors  `x` [2, 3, 224, 224] and its F32 `logits` [2, 1000], computed
                                   with TF32 off, on the GPU when there is one, else on the CPU.
Needs torch and torchvision. Without the safetensors package (a GPU machine where nothing can be
installed) the files are written by hand in the same format (struct + json, no numpy).
"""
import ctypes
import json
import os
import struct
import sys

import torch
import torchvision

try:
    from safetensors.torch import save_file
except ImportError:  # the format by hand: u64 header length, JSON header, little-endian data
    DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64"}

    def save_file(tensors, path, metadata=None):
        items = sorted(((k, v.detach().to("cpu").contiguous()) for k, v in tensors.items()),
                       key=lambda kv: (-kv[1].element_size(), kv[0]))
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = metadata
        for k, v in items:
            n = v.numel() * v.element_size()
            header[k] = {"dtype": DTYPES[v.dtype], "shape": list(v.shape),
                         "data_offsets": [offset, offset + n]}
            offset += n
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for _, v in items:  # the host is little-endian (x86-64, aarch64)
                f.write(ctypes.string_at(v.data_ptr(), v.numel() * v.element_size()))
        os.replace(tmp, path)
    print("safetensors package not found: writing the format by hand")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    m = torchvision.models.resnet18(num_classes=1000)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                c = mod.num_features
                mod.weight.copy_(torch.rand(c, generator=g) * 0.5 + 0.5)
                mod.bias.copy_(torch.randn(c, generator=g) * 0.1)
                mod.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
                mod.num_batches_tracked.fill_(int(torch.randint(1, 1000, (), generator=g)))
    m = m.eval()
    save_file(m.state_dict(), os.path.join(out, "resnet18.safetensors"), metadata={"format": "pt"})

    x = torch.randn(2, 3, 224, 224, generator=g)
    with torch.no_grad():
        logits = m.to(dev)(x.to(dev)).float().cpu()
    save_file({"x": x, "logits": logits}, os.path.join(out, "resnet18_io.safetensors"))
    print(f"wrote {out}/resnet18.safetensors and {out}/resnet18_io.safetensors "
          f"(torch {torch.__version__}, torchvision {torchvision.__version__}, logits on {dev}, "
          f"TF32 off; |logits| max {logits.abs().max():.4g})")


if __name__ == "__main__":
    main()
