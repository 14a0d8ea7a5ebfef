"""PyTorch twin of src/io/hf_gpt2.rs: exports a seeded tiny GPT-2 as a Hugging Face
`GPT2LMHeadModel` safetensors file and its fp32 logits on seeded token ids, for the logits
comparison with mixprec's GPT-2 (load the file with `mixprec::io::hf_gpt2::load_hf_gpt2`, run
the same ids, compare), and checks a file written by `save_hf_gpt2` the other way round.

    python3 benches/torch_hf_gpt2_export.py --out DIR [--layers 2 --heads 2 --d 64 --ctx 64
        --batch 2 --seed 0 --device cpu]
      writes DIR/model.safetensors (+ DIR/config.json with transformers) and
      DIR/logits.safetensors: input_ids I64 [batch, ctx], logits F32 [batch, ctx, 50257]
    python3 benches/torch_hf_gpt2_export.py --out DIR --check OURS.safetensors
      loads OURS into a GPT2LMHeadModel of the same config, runs DIR's input_ids and prints
      the largest |difference| from DIR's logits (one JSON line)

Uses `transformers` when it is installed (it is on the GPU machine) and otherwise a GPT-2
written out in plain torch under the same names and layouts (Conv1D weights [in, out], the
head tied to wte, causal-mask buffers not saved). TF32 is off: the logits are plain fp32.
"""
import argparse, json, math, os
import torch, torch.nn as nn, torch.nn.functional as F
from safetensors.torch import load_file, save_file

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--heads", type=int, default=2)
ap.add_argument("--d", type=int, default=64)
ap.add_argument("--ctx", type=int, default=64)
ap.add_argument("--vocab", type=int, default=50257)
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--device", default="cpu")
ap.add_argument("--check", default="", help="a file written by save_hf_gpt2 to compare")
ap.add_argument("--plain", action="store_true", help="plain torch even if transformers exists")
args = ap.parse_args()
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


class Conv1D(nn.Module):
    """transformers' Conv1D: y = x @ weight + bias, weight [in, out]."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out).normal_(0, 0.02))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], -1)


class Block(nn.Module):
    def __init__(self, d, h, layers):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(d, 3 * d), Conv1D(d, d)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(d, 4 * d), Conv1D(4 * d, d)
        for p in (self.attn.c_proj.weight, self.mlp.c_proj.weight):
            p.data.normal_(0, 0.02 / math.sqrt(2 * layers))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        a = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = a.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT2(nn.Module):
    """GPT-2 under GPT2LMHeadModel's names, for machines without transformers."""

    def __init__(self, V, T, L, H, d):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte, self.transformer.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        for e in (self.transformer.wte, self.transformer.wpe):
            e.weight.data.normal_(0, 0.02)
        self.transformer.h = nn.ModuleList(Block(d, H, L) for _ in range(L))
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in t.h:
            x = b(x)
        return self.lm_head(t.ln_f(x))


def build():
    """(model, kind, save(path_dir)), seeded."""
    torch.manual_seed(args.seed)
    if not args.plain:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            GPT2LMHeadModel = None
        if GPT2LMHeadModel is not None:
            cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.ctx, n_embd=args.d,
                             n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new")
            m = GPT2LMHeadModel(cfg)
            return m, "transformers", lambda d: m.save_pretrained(d)
    m = PlainGPT2(args.vocab, args.ctx, args.layers, args.heads, args.d)

    def save(d):
        sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
        save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})

    return m, "plain torch", save


def logits_of(m, ids):
    with torch.no_grad():
        out = m(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


os.makedirs(args.out, exist_ok=True)
model, kind, save = build()
model = model.to(args.device).eval()
logits_path = os.path.join(args.out, "logits.safetensors")
if args.check:
    ref = load_file(logits_path)
    ids = ref["input_ids"].to(args.device)
    sd = load_file(args.check)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # The tied head and the (non-persistent) mask buffers are all a GPT-2 file may lack.
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias")]
    diff = (logits_of(model, ids).cpu() - ref["logits"]).abs().max().item()
    print(json.dumps({"check": args.check, "kind": kind, "missing": missing,
                      "unexpected": list(unexpected), "max_abs_diff": diff,
                      "ok": not missing and not unexpected and diff <= 1e-4}))
else:
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.ctx), generator=g)
    ids[:, 0] = 50256 if args.vocab > 50256 else 0  # a document starts with <|endoftext|>
    logits = logits_of(model, ids.to(args.device)).cpu().contiguous()
    save(args.out)
    save_file({"input_ids": ids.contiguous(), "logits": logits}, logits_path,
              metadata={"format": "pt", "config": json.dumps(vars(args)), "kind": kind})
    names = sorted(load_file(os.path.join(args.out, "model.safetensors")).keys())
    print(json.dumps({"out": args.out, "kind": kind, "tensors": len(names),
                      "first": names[:3], "logits": list(logits.shape),
                      "logits_abs_mean": logits.abs().mean().item()}))
