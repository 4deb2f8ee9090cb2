#!/usr/bin/python3
"""Train the two effattn-lm byte-level models (FORMAT.md) on the KJV Bible and export them.

Run (from the repository root; Debian's torch, not a pyenv python):

    /usr/bin/python3 examples/lm/train.py --model decoder|encoder|all [--out examples/lm]
    /usr/bin/python3 examples/lm/train.py --model all --smoke     # pipeline test, ~3 minutes,
                                                                  # writes to /tmp/effattn-lm-smoke
    /usr/bin/python3 examples/lm/train.py --model decoder --steps N

Needs the Debian packages python3-torch (1.13), bible-kjv and bible-kjv-text. Progress goes to
stdout and, one line, to STATUS at the repository root.

What it does, per model (FORMAT.md is the contract with the C++ runner):
  1. Builds the text: `bible -f Gen1:1-Rev22:21`, verse references stripped, one verse per line
     (4137850 bytes); the last 131072 bytes are the held-out split, written to
     data/heldout.txt; its SHA-256 must equal the one already in reference.json, if any.
  2. Trains with fixed seeds and a fixed step count (CONFIGS below): random windows of the
     training bytes drawn from a seeded torch.Generator; AdamW (betas 0.9/0.95, weight decay 0.1
     on the matrices only), linear warmup then cosine decay to 10 % of lr 2e-3, gradient
     clipping at 1.0; init N(0, 0.02), wo and w2 scaled by 1/sqrt(2L). Matmuls run in bf16
     under torch.autocast (oneDNN, ~4x float32 here; float32 master weights, softmax, norms and
     loss). The decoder's causal attention is computed in 8 query blocks that skip the
     invisible keys (same result, less work).
       decoder: D 256, 4 layers, 4 query heads / 2 kv heads (GQA), head_dim 64, d_ff 768,
                vocab 256, causal next-byte prediction on 4 x 2048 bytes per step.
       encoder: same sizes with 4 kv heads, vocab 257 (MASK = 256), bidirectional masked-byte
                prediction on 8 x 1024 bytes per step: 15 % of the positions selected, of
                those 80 % -> MASK, 10 % a random byte, 10 % unchanged; loss on the selected.
  3. Rounds every weight to fp16, then computes all reference figures from those weights in
     float32 (no autocast; plain max-subtracted softmax): held-out bits per byte at contexts
     1024 and 2048 (every full window, and the first 4 windows), the 128-token logit fixture.
  4. Writes weights/<model>.eflm and fixtures/<model>.bin, reads both back (checksum, names,
     shapes; a fresh model loaded from the file gives bit-identical logits) and merges the
     model's entry into reference.json.

BLAS: Debian's torch is linked against the reference BLAS (libblas.so.3, ~5 GFLOP/s on this
machine), which only the float32 evaluation uses. If Debian's libopenblas0-pthread is installed
it provides libblas.so.3; otherwise this script re-executes itself once with LD_LIBRARY_PATH set
to an unpacked copy, $EFFATTN_LM_OPENBLAS or .cache/openblas/root/usr/lib/x86_64-linux-gnu/
openblas-pthread (made by `apt-get download libopenblas0-pthread` and
`dpkg -x libopenblas0-pthread_*.deb .cache/openblas/root`), when there is one. The BLAS used is
recorded in reference.json. Results are deterministic for a given machine and library set;
another BLAS or CPU changes the last bits of training and so the weights.

Measured (2 cores, shared): decoder 450 steps in 1012 s, final train loss 1.321 nats (1.906 bits), held-out
2.032 bpb at 1024 / 2.026 at 2048; encoder 700 steps in 1711 s, final train loss (masked
positions) 1.120 nats (1.615 bits), held-out 1.817 bpb at 1024 / 1.848 at 2048. Together
45 minutes of training plus ~1.5 minutes of evaluation and export per model. The exact figures
are in reference.json; check_reference.py recomputes the fixtures and the first-4-window
figures with an independent float64 numpy forward.

Licence of the data: the King James Version (1611) is in the public domain (copyright expired;
see /usr/share/doc/bible-kjv-text/copyright and FORMAT.md), so the held-out text and the trained
weights are shipped under the repository's licence.
"""

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OPENBLAS_SUBDIR = "usr/lib/x86_64-linux-gnu/openblas-pthread"


def _blas_candidates():
    env = os.environ.get("EFFATTN_LM_OPENBLAS")
    if env:
        yield env
    yield os.path.join(REPO, ".cache", "openblas", "root", OPENBLAS_SUBDIR)


def _maybe_reexec_with_openblas():
    """Debian's torch links the reference BLAS (libblas.so.3, ~5 GFLOP/s here); OpenBLAS is ~25x
    faster. Unless libopenblas0-pthread is installed (it then provides libblas.so.3), restart this
    process once with LD_LIBRARY_PATH pointing at an unpacked copy, if there is one."""
    if os.environ.get("EFFATTN_LM_REEXEC") or os.path.exists("/" + OPENBLAS_SUBDIR):
        return
    for d in _blas_candidates():
        if os.path.exists(os.path.join(d, "libblas.so.3")):
            env = dict(os.environ, EFFATTN_LM_REEXEC="1",
                       LD_LIBRARY_PATH=d + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
            os.execve(sys.executable, [sys.executable] + sys.argv, env)


if __name__ == "__main__":
    _maybe_reexec_with_openblas()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, HERE)
import lm_format  # noqa: E402

RANDOM_ALPHABET = torch.tensor([ord(c) for c in "abcdefghijklmnopqrstuvwxyz "])
THREADS = int(os.environ.get("EFFATTN_LM_THREADS", "2"))  # torch threads (training, evaluation)
HELDOUT_BYTES = 131072
EVAL_CONTEXTS = (1024, 2048)
FIXTURE_TOKENS = 128
MASK_TOKEN = 256
SMOKE_OUT = "/tmp/effattn-lm-smoke"

# `--repeats`: decoder training windows with passages repeated verbatim later in the same window
# (as refrains, quotations and parallel passages do in real text), so that predicting a byte pays
# off from retrieving it from far back, and the model should learn to copy: with probability
# `prob` a window receives 1..`copies` copies, each of a passage of `min_len`..`max_len` bytes
# (log-uniform) from earlier in the window, right after its original with probability `near`,
# otherwise at any distance up to the whole window; with probability `random` the passage is
# first overwritten by a random string of a-z and space; with probability `cipher` the window's
# letters are first replaced through a random permutation of the alphabet, so that the copies can
# only be predicted by looking them up. Not part of the shipped decoder's recipe: at 700 steps of
# 2 x 4096 bytes no copying emerged (docs/developer_notes.md).
REPEATS = dict(prob=1.0, copies=6, min_len=32, max_len=512, cipher=0.2, random=0.5, near=0.5)

COMMON = dict(d_model=256, layers=4, heads=4, head_dim=64, d_ff=768, rope_base=10000.0,
              norm_eps=1e-5, lr=2e-3, min_lr_ratio=0.1, betas=(0.9, 0.95), weight_decay=0.1,
              grad_clip=1.0, init_std=0.02)
CONFIGS = {
    "decoder": dict(COMMON, kind=lm_format.KIND_DECODER, vocab=256, kv_heads=2, context=2048,
                    mask_token=lm_format.NO_MASK_TOKEN, batch=4, steps=450, warmup=30,
                    attn_blocks=8, seed=20, data_seed=21),
    "encoder": dict(COMMON, kind=lm_format.KIND_ENCODER, vocab=257, kv_heads=4, context=1024,
                    mask_token=MASK_TOKEN, mask_prob=0.15, batch=8, steps=700, warmup=40,
                    attn_blocks=1, seed=30, data_seed=31),
}

# `--attention`: train (and evaluate) with an effattn method in every attention layer, through
# effattn.torch (effattn's C++ forward and backward), with the options effattn-lm runs that
# method with at its default budget (lm_attention.hpp), so that `effattn-lm eval --weights
# weights/<model>-<attention>.eflm --method NAME` computes the function that was trained.
ATTENTION = {
    "softmax": None,  # torch's matmul / softmax / matmul (the shipped models)
    "eva": ("eva", {"window": 64, "chunk_size": 16}),
    "performer": ("performer", {"features": 256, "seed": 42}),
    "conv_basis": ("conv_basis", {"num_bases": 16}),
    "kep_svgp": None,  # softmax in every layer but the last, which is KEP_SVGP's learned layer
}
# Which model kinds a method can train: the causal-only and non-causal methods.
ATTENTION_MODELS = {"softmax": ("decoder", "encoder"), "eva": ("decoder", "encoder"),
                    "performer": ("encoder",), "conv_basis": ("decoder",),
                    "kep_svgp": ("encoder",)}

# `--attention kep_svgp`: KEP-SVGP's learned layer (effattn.torch.kep_svgp_layer, pinned to
# effattn.kep_svgp_layer) in the encoder's last attention layer, as its paper trains it for
# text: last layer only, cosine kernel, addition merge, rank s = 10, per head; loss = masked-byte
# cross-entropy + eta_ksvd * J^2 (the KSVD loss with means, averaged over windows and heads) +
# eta_kl * KL (summed over heads), with its code's weights for the addition merge (eta_ksvd 1,
# eta_kl 1) and initialisation (W_e, W_r orthogonal, Lambda^-1/2 = exp(U(0, 1)), m_u and the
# factors' log-diagonal and strictly lower part N(0, 1), W_add as torch's Linear(s, head_dim)).
# One posterior draw per token and value column in training (marginal sampling); the posterior
# mean for held-out bits per byte. Two deviations from the official code: W_e and W_r are
# parameters (eq. 10) rather than generated from 100 subsampled tokens of the layer input, and
# the layer keeps the model's RoPE on q and k (a rotation: the cosine kernel is unchanged in form).
# The KEP parameters are excluded from weight decay (the KL is their prior). Its weights:
# weights/encoder-kep_svgp.eflm (the rest of the model; the last layer's wv is unused) and
# weights/encoder-kep_svgp.kep.npz (the layer's parameters, fp16-rounded, stored as float32).
# Gradient clipping (at grad_clip, as every recipe) is applied to the KEP parameters and to the
# rest of the model separately: the KL's gradient (thousands of nats at initialisation) would
# otherwise set the global norm and scale the cross-entropy's gradient of every other weight
# down by as much (measured: the training loss stalled at 3.0 nats from step 40 to 200).
KEP_SVGP = dict(rank=10, merge="addition", eta_ksvd=1.0, eta_kl=1.0, clip="separate")


def output_name(model, attention, seed_offset):
    """weights/<name>.eflm: `decoder`, `decoder-eva`, `encoder-seed2`, ..."""
    name = model if attention == "softmax" else f"{model}-{attention}"
    return name + (f"-seed{seed_offset + 1}" if seed_offset else "")


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------

def build_text():
    """The KJV text of FORMAT.md: one verse per line, the reference and its space removed."""
    raw = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True,
                         capture_output=True).stdout.decode("ascii")
    lines = raw.rstrip("\n").split("\n")
    return ("\n".join(line.split(" ", 1)[1] for line in lines) + "\n").encode("ascii")


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

def rope_tables(T, hd, base):
    """cos, sin (T x hd/2, float32) of theta = t * base^(-2i/hd), computed in float64."""
    i = torch.arange(hd // 2, dtype=torch.float64)
    inv = torch.tensor(float(base), dtype=torch.float64) ** (-2.0 * i / hd)
    theta = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(theta).float(), torch.sin(theta).float()


def apply_rope(x, cos, sin):
    """x: B x T x heads x hd, NeoX half layout (pair i couples i and i + hd/2)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


def rmsnorm(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class LM(torch.nn.Module):
    """The pre-norm transformer of FORMAT.md (no biases, tied embeddings)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, H, G, hd, Fd, V = (cfg["d_model"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"],
                              cfg["d_ff"], cfg["vocab"])
        P = torch.nn.Parameter
        self.params = torch.nn.ParameterDict()
        self.params["embed"] = P(torch.empty(V, D))
        for l in range(cfg["layers"]):
            p = f"layers.{l}."
            for name, shape in (("attn_norm", (D,)), ("wq", (H * hd, D)), ("wk", (G * hd, D)),
                                ("wv", (G * hd, D)), ("wo", (D, H * hd)), ("mlp_norm", (D,)),
                                ("w1", (Fd, D)), ("w2", (D, Fd))):
                self.params[(p + name).replace(".", "_")] = P(torch.empty(shape))
        self.params["final_norm"] = P(torch.empty(D))
        # KEP-SVGP's learned layer in the last attention layer (KEP_SVGP), per head h:
        # w_e, w_r (H, hd, s); theta (H, s) with Lambda^-1/2 = exp(theta); m_u (H, s, s);
        # the factors L_c = tril(l_lower[h, c], -1) + diag(exp(l_logdiag[h, c])); w_add (H, hd, s).
        self.kep = None
        self.kep_sample = False  # draw from the posterior (training) or take its mean
        self.kep_aux = None  # (KSVD loss J^2 averaged over windows and heads, KL summed over heads)
        kep = cfg.get("kep_svgp")
        if kep:
            s = kep["rank"]
            self.kep = torch.nn.ParameterDict({
                "w_e": P(torch.empty(H, hd, s)), "w_r": P(torch.empty(H, hd, s)),
                "theta": P(torch.empty(H, s)), "m_u": P(torch.empty(H, s, s)),
                "l_logdiag": P(torch.empty(H, s, s)), "l_lower": P(torch.empty(H, s, s, s)),
                "w_add": P(torch.empty(H, hd, s))})
        self._cache = {}
        # None: torch's matmul / softmax / matmul (attention() below); otherwise an effattn
        # method name run through effattn.torch (differentiable C++ kernels), with its options.
        self.effattn_method = None
        self.effattn_options = {}

    def reset_parameters(self):
        std = self.cfg["init_std"]
        out_std = std / math.sqrt(2 * self.cfg["layers"])
        with torch.no_grad():
            for key, p in self.params.items():
                if p.dim() == 1:
                    p.fill_(1.0)
                elif key.endswith("_wo") or key.endswith("_w2"):
                    p.normal_(0.0, out_std)
                else:
                    p.normal_(0.0, std)
            if self.kep is not None:
                s = self.kep["theta"].shape[1]
                for h in range(self.kep["w_e"].shape[0]):
                    torch.nn.init.orthogonal_(self.kep["w_e"][h])
                    torch.nn.init.orthogonal_(self.kep["w_r"][h])
                self.kep["theta"].uniform_(0.0, 1.0)
                self.kep["m_u"].normal_(0.0, 1.0)
                self.kep["l_logdiag"].normal_(0.0, 1.0)
                self.kep["l_lower"].normal_(0.0, 1.0)
                self.kep["w_add"].uniform_(-1.0 / math.sqrt(s), 1.0 / math.sqrt(s))

    def kep_params(self):
        """KEP-SVGP's layer as effattn.kep_svgp_layer takes it: (w_e, w_r, lambda, m_u, l_u)."""
        kp = self.kep
        lam = torch.exp(-2.0 * kp["theta"])
        l_u = kp["l_lower"].tril(-1) + torch.diag_embed(kp["l_logdiag"].exp())
        return kp["w_e"], kp["w_r"], lam, kp["m_u"], l_u

    def kep_attention(self, q, k):
        """KEP-SVGP's learned layer: q, k B x T x H x hd (RoPE applied) -> B x T x H*hd, in
        float32; sets kep_aux."""
        import effattn.torch as et

        B, T, H, hd = q.shape
        merge = self.cfg["kep_svgp"]["merge"]
        with torch.autocast("cpu", enabled=False):
            w_e, w_r, lam, m_u, l_u = self.kep_params()
            mean, var, e, r = et.kep_svgp_layer(q.float().transpose(1, 2),
                                                k.float().transpose(1, 2), w_e[None], w_r[None],
                                                lam[None], m_u[None], l_u[None], merge)
            f = mean + var.clamp_min(1e-30).sqrt() * torch.randn_like(mean) \
                if self.kep_sample else mean
            out = f @ self.kep["w_add"].transpose(1, 2)[None]  # B x H x T x hd
            ksvd = et.kep_svgp_ksvd_loss(e, r, lam[None], w_e[None], w_r[None], "mean").mean()
            self.kep_aux = (ksvd, et.kep_svgp_kl(lam, m_u, l_u))
        return out.transpose(1, 2).reshape(B, T, H * hd)

    def p(self, name):
        return self.params[name.replace(".", "_")]

    def named_format_tensors(self):
        """FORMAT.md name -> parameter."""
        return {n: self.p(n) for n in lm_format.tensor_names(self.cfg["layers"])}

    def rope(self, T):
        if T not in self._cache:
            self._cache[T] = rope_tables(T, self.cfg["head_dim"], self.cfg["rope_base"])
        return self._cache[T]

    def causal_mask(self, lo, hi):
        """Additive float32 mask, queries lo..hi-1 x keys 0..hi-1: -inf where key > query."""
        key = ("mask", lo, hi)
        if key not in self._cache:
            above = torch.ones(hi - lo, hi, dtype=torch.bool).triu(lo + 1)
            self._cache[key] = torch.zeros(hi - lo, hi).masked_fill(above, float("-inf"))
        return self._cache[key]

    def attention(self, q, k, v, causal, blocks):
        """q: B x T x H x hd, k, v: B x T x G x hd; returns B x T x H*hd.

        float32, plain max-subtracted softmax (torch.softmax). Query head h reads key/value head
        h // (H/G). With causal and blocks > 1 the queries are processed in blocks that only
        multiply the keys they can see (same result, less work; training only)."""
        B, T, H, hd = q.shape
        if self.effattn_method is not None:
            # effattn.torch on (B, H, T, hd) views of the (B, T, H, hd) activations: read in
            # place (bf16 ones under autocast are converted to float32 once).
            import effattn.torch as et

            o = et.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             self.effattn_method, causal, **self.effattn_options)
            return o.transpose(1, 2).reshape(B, T, H * hd)
        G = k.shape[2]
        rep = H // G
        scale = 1.0 / math.sqrt(hd)
        # B*G x rep x T x hd: the rep query heads sharing one key/value head side by side.
        qg = q.permute(0, 2, 1, 3).reshape(B * G, rep, T, hd)
        kg = k.permute(0, 2, 1, 3).reshape(B * G, T, hd)
        vg = v.permute(0, 2, 1, 3).reshape(B * G, T, hd)
        if not causal:
            s = torch.matmul(qg * scale, kg.transpose(1, 2)[:, None])
            o = torch.matmul(torch.softmax(s.float(), dim=-1), vg[:, None])
        else:
            if blocks < 1 or T % blocks:
                blocks = 1
            bs = T // blocks
            outs = []
            for b in range(blocks):
                lo, hi = b * bs, (b + 1) * bs
                s = torch.matmul(qg[:, :, lo:hi] * scale, kg[:, None, :hi].transpose(2, 3))
                s = s.float() + self.causal_mask(lo, hi)
                outs.append(torch.matmul(torch.softmax(s, dim=-1), vg[:, None, :hi]))
            o = torch.cat(outs, dim=2) if blocks > 1 else outs[0]
        # B*G x rep x T x hd -> B x T x H*hd (head h = g*rep + r)
        return o.reshape(B, H, T, hd).permute(0, 2, 1, 3).reshape(B, T, H * hd)

    def hidden(self, tokens, blocks=1):
        """tokens: B x T (long) -> final-normed hidden states B x T x D."""
        c = self.cfg
        B, T = tokens.shape
        H, G, hd, eps = c["heads"], c["kv_heads"], c["head_dim"], c["norm_eps"]
        causal = c["kind"] == lm_format.KIND_DECODER
        cos, sin = self.rope(T)
        x = F.embedding(tokens, self.p("embed"))
        for l in range(c["layers"]):
            p = f"layers.{l}."
            h = rmsnorm(x, self.p(p + "attn_norm"), eps)
            q = F.linear(h, self.p(p + "wq")).view(B, T, H, hd)
            k = F.linear(h, self.p(p + "wk")).view(B, T, G, hd)
            v = F.linear(h, self.p(p + "wv")).view(B, T, G, hd)
            if self.kep is not None and l == c["layers"] - 1:
                a = self.kep_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin))
            else:
                a = self.attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, causal,
                                   blocks)
            x = x + F.linear(a, self.p(p + "wo"))
            h = rmsnorm(x, self.p(p + "mlp_norm"), eps)
            x = x + F.linear(F.gelu(F.linear(h, self.p(p + "w1"))), self.p(p + "w2"))
        return rmsnorm(x, self.p("final_norm"), eps)

    def logits(self, h):
        return F.linear(h, self.p("embed"))

    def forward(self, tokens, blocks=1):
        return self.logits(self.hidden(tokens, blocks))


def load_format_tensors(model, tensors):
    """Copy FORMAT.md-named arrays (rows x cols) into the model's parameters."""
    with torch.no_grad():
        for name, p in model.named_format_tensors().items():
            p.copy_(torch.from_numpy(tensors[name]).reshape(p.shape))


def kep_path(eflm_path):
    """weights/<name>.kep.npz beside weights/<name>.eflm: KEP-SVGP's layer parameters."""
    return eflm_path[:-len(".eflm")] + ".kep.npz"


def save_kep(model, path):
    np.savez(path, **{k: v.detach().numpy() for k, v in model.kep.items()})


def load_kep(model, path):
    """Copy a .kep.npz of save_kep into the model's KEP-SVGP layer (shapes must match)."""
    with np.load(path) as z:
        if set(z.files) != set(model.kep.keys()):
            raise ValueError(f"{path}: tensors {sorted(z.files)}, expected {sorted(model.kep)}")
        with torch.no_grad():
            for k, p in model.kep.items():
                if tuple(z[k].shape) != tuple(p.shape):
                    raise ValueError(f"{path}: {k} is {z[k].shape}, expected {tuple(p.shape)}")
                p.copy_(torch.from_numpy(z[k]))


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def lr_at(step, cfg):
    """Linear warmup to lr, then cosine decay to min_lr_ratio * lr at the last step."""
    lr, warm, steps = cfg["lr"], cfg["warmup"], cfg["steps"]
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - 1 - warm)
    lo = cfg["min_lr_ratio"]
    return lr * (lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


def sample_batch(data, cfg, gen):
    """Random windows of the training bytes (uint8 tensor), drawn from ``gen``.

    decoder: (input B x C, target B x C, None), the target shifted by one byte.
    encoder: (corrupted input B x C, original B x C, masked B x C bool): each position is
    selected with probability mask_prob; a selected position becomes MASK with probability 0.8,
    a uniformly random byte with 0.1 and stays unchanged with 0.1."""
    B, C = cfg["batch"], cfg["context"]
    decoder = cfg["kind"] == lm_format.KIND_DECODER
    span = C + 1 if decoder else C
    starts = torch.randint(0, len(data) - span + 1, (B,), generator=gen)
    win = data[starts[:, None] + torch.arange(span)[None, :]].long()
    if decoder:
        if cfg.get("repeats"):
            insert_repeats(win, cfg["repeats"], gen)
        return win[:, :-1], win[:, 1:], None
    masked = torch.rand(B, C, generator=gen) < cfg["mask_prob"]
    r = torch.rand(B, C, generator=gen)
    rand_bytes = torch.randint(0, 256, (B, C), generator=gen)
    inp = win.clone()
    inp[masked & (r < 0.8)] = cfg["mask_token"]
    swap = masked & (r >= 0.8) & (r < 0.9)
    inp[swap] = rand_bytes[swap]
    return inp, win, masked


def _randint(lo, hi, gen):
    """Uniform integer in [lo, hi] from ``gen``."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def cipher_letters(row, gen):
    """Replaces the letters of ``row`` (long tensor of bytes) in place through one random
    permutation of a-z (and the same one of A-Z)."""
    perm = torch.randperm(26, generator=gen)
    table = torch.arange(256)
    table[ord("a"):ord("z") + 1] = perm + ord("a")
    table[ord("A"):ord("Z") + 1] = perm + ord("A")
    row.copy_(table[row])


def insert_repeats(win, rep, gen):
    """In place, per row of ``win`` (B x S bytes): REPEATS' copies of earlier passages."""
    S = win.shape[1]
    lo, hi = math.log(rep["min_len"]), math.log(min(rep["max_len"], S // 2))
    for row in win:
        if float(torch.rand(1, generator=gen)) >= rep["prob"]:
            continue
        if float(torch.rand(1, generator=gen)) < rep["cipher"]:
            cipher_letters(row, gen)
        for _ in range(_randint(1, rep["copies"], gen)):
            L = int(math.exp(lo + (hi - lo) * float(torch.rand(1, generator=gen))))
            if float(torch.rand(1, generator=gen)) < rep.get("near", 0.0):
                # Right after its original (a gap of up to 64 bytes): short-range copies are
                # what the model first learns to find; the far ones then use the same heads.
                src = _randint(0, S - 2 * L - 64, gen) if S > 2 * L + 64 else 0
                dst = min(src + L + _randint(0, 64, gen), S - L)
            else:
                dst = _randint(L, S - L, gen)  # the copy's start; its source ends before it
                src = _randint(0, dst - L, gen)
            if float(torch.rand(1, generator=gen)) < rep.get("random", 0.0):
                # A random string of a-z and space: its first occurrence cannot be predicted at
                # all, its copy only by looking the first one up.
                row[src:src + L] = RANDOM_ALPHABET[torch.randint(0, len(RANDOM_ALPHABET), (L,),
                                                                 generator=gen)]
            row[dst:dst + L] = row[src:src + L].clone()


def write_status(text):
    path = os.path.join(REPO, "STATUS")
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)


CHECKPOINT_EVERY = 50


def checkpoint_path(name, cfg):
    """Where training of ``name`` checkpoints; the name carries a hash of the configuration, so
    a checkpoint of another recipe is never resumed."""
    key = json.dumps({k: v for k, v in cfg.items() if not k.startswith("_")}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(REPO, ".cache", "lm-train", f"{name}-{digest}.pt")


def use_attention(model, attention):
    """Points the model's attention at `attention` (a key of ATTENTION)."""
    spec = ATTENTION[attention]
    model.effattn_method, model.effattn_options = (None, {}) if spec is None else \
        (spec[0], dict(spec[1]))


def train(name, cfg, log):
    """Train one model; returns (model, final train loss in nats, seconds).

    Every CHECKPOINT_EVERY steps the model, optimiser, data generator and losses are saved under
    .cache/lm-train/ (atomically); a later run of the same recipe resumes from the last one, with
    the same result as an uninterrupted run. The checkpoint is removed when training ends."""
    torch.manual_seed(cfg["seed"])
    model = LM(cfg)
    model.reset_parameters()
    use_attention(model, cfg.get("attention", "softmax"))
    gen = torch.Generator().manual_seed(cfg["data_seed"])
    data = torch.frombuffer(bytearray(cfg["_train_bytes"]), dtype=torch.uint8)
    decay = [p for p in model.params.values() if p.dim() == 2]
    no_decay = [p for p in model.params.values() if p.dim() < 2]
    if model.kep is not None:  # KEP-SVGP's layer: its prior is the KL term, no weight decay
        no_decay += list(model.kep.values())
        model.kep_sample = True
    kep = cfg.get("kep_svgp")
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=cfg["betas"])
    decoder = cfg["kind"] == lm_format.KIND_DECODER
    losses = []
    first, spent = 0, 0.0
    ckpt = checkpoint_path(name, cfg)
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        torch.set_rng_state(state["rng"])
        losses, first, spent = state["losses"], state["step"], state["seconds"]
        log(f"{name}: resumed from {ckpt} at step {first}")
    t0 = time.time() - spent
    for step in range(first, cfg["steps"]):
        if step > first and step % CHECKPOINT_EVERY == 0:
            os.makedirs(os.path.dirname(ckpt), exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "gen": gen.get_state(), "rng": torch.get_rng_state(), "losses": losses,
                        "step": step, "seconds": time.time() - t0}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        inp, target, masked = sample_batch(data, cfg, gen)
        # Mixed precision: bf16 matmuls (oneDNN, ~4x the float32 speed here), float32 master
        # weights, softmax, norms and loss.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.hidden(inp, blocks=cfg["attn_blocks"])
        h = h.float()
        if decoder:
            logits = model.logits(h)
            loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), target.reshape(-1))
        else:
            loss = F.cross_entropy(model.logits(h[masked]), target[masked])
        total = loss
        if kep:
            ksvd, kl = model.kep_aux
            total = loss + kep["eta_ksvd"] * ksvd + kep["eta_kl"] * kl
        opt.zero_grad(set_to_none=True)
        total.backward()
        if kep:
            torch.nn.utils.clip_grad_norm_(list(model.params.values()), cfg["grad_clip"])
            torch.nn.utils.clip_grad_norm_(list(model.kep.values()), cfg["grad_clip"])
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        losses.append(loss.item())
        elapsed = time.time() - t0
        recent = sum(losses[-20:]) / len(losses[-20:])
        write_status(f"{name} step {step + 1}/{cfg['steps']} loss {recent:.4f} "
                     f"({recent / math.log(2):.3f} bits) elapsed {elapsed:.0f}s")
        if step % 10 == 0 or step + 1 == cfg["steps"]:
            log(f"{name} step {step + 1}/{cfg['steps']} lr {lr_at(step, cfg):.2e} "
                f"loss {loss.item():.4f} avg20 {recent:.4f} elapsed {elapsed:.0f}s "
                f"({(step + 1) * cfg['batch'] * cfg['context'] / elapsed:.0f} tok/s)"
                + (f" ksvd {model.kep_aux[0].item():.4g} kl {model.kep_aux[1].item():.4g}"
                   if kep else ""))
    seconds = time.time() - t0
    final = sum(losses[-20:]) / len(losses[-20:])
    if os.path.exists(ckpt):
        os.remove(ckpt)
    model.kep_sample = False
    return model, final, seconds


def round_to_fp16(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
            if not torch.isfinite(p).all():
                raise RuntimeError("a weight overflows fp16")


# ----------------------------------------------------------------------------------------------
# Evaluation (FORMAT.md "Evaluation"); float32 forward, float64 accumulation
# ----------------------------------------------------------------------------------------------

def encoder_masked_window(window_bytes, w, mask_token):
    """(masked input list, mask list) of evaluation window w."""
    mask = lm_format.encoder_eval_mask(w, len(window_bytes))
    return [mask_token if m else b for b, m in zip(window_bytes, mask)], mask


@torch.no_grad()
def heldout_bits(model, heldout, C, batch=4):
    """Per-window (sum of bits, predicted positions) over every full window of C bytes."""
    cfg = model.cfg
    n = len(heldout) // C
    out = []
    for w0 in range(0, n, batch):
        ws = range(w0, min(n, w0 + batch))
        raw = [list(heldout[w * C:(w + 1) * C]) for w in ws]
        if cfg["kind"] == lm_format.KIND_DECODER:
            tokens = torch.tensor(raw)
            logp = model(tokens).double().log_softmax(-1)
            nll = -logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
            out += [(float(r.sum()) / math.log(2), C - 1) for r in nll]
        else:
            pairs = [encoder_masked_window(r, w, cfg["mask_token"]) for r, w in zip(raw, ws)]
            tokens = torch.tensor([p[0] for p in pairs])
            masks = torch.tensor([p[1] for p in pairs])
            logp = model(tokens).double().log_softmax(-1)
            nll = -logp.gather(-1, torch.tensor(raw)[..., None])[..., 0]
            out += [(float(r[m].sum()) / math.log(2), int(m.sum())) for r, m in zip(nll, masks)]
    return out


def bpb(pairs):
    return sum(b for b, _ in pairs) / sum(n for _, n in pairs)


def fixture_tokens(model, heldout):
    raw = list(heldout[:FIXTURE_TOKENS])
    if model.cfg["kind"] == lm_format.KIND_ENCODER:
        return encoder_masked_window(raw, 0, model.cfg["mask_token"])[0]
    return raw


@torch.no_grad()
def fixture_logits(model, tokens):
    return model(torch.tensor([tokens]))[0].float()


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------

HEADER_KEYS = lm_format.HEADER_U32 + ("rope_base", "norm_eps")


def export(name, model, heldout, out_dir, log):
    """Write weights/<name>.eflm and fixtures/<name>.bin; read both back and check them."""
    cfg = model.cfg
    header = {k: cfg[k] for k in HEADER_KEYS}
    wpath = os.path.join(out_dir, "weights", f"{name}.eflm")
    fpath = os.path.join(out_dir, "fixtures", f"{name}.bin")
    os.makedirs(os.path.dirname(wpath), exist_ok=True)
    os.makedirs(os.path.dirname(fpath), exist_ok=True)
    tensors = {n: p.detach().numpy() for n, p in model.named_format_tensors().items()}
    checksum = lm_format.write_eflm(wpath, header, tensors)
    if model.kep is not None:
        save_kep(model, kep_path(wpath))
    tokens = fixture_tokens(model, heldout)
    logits = fixture_logits(model, tokens)
    lm_format.write_fixture(fpath, tokens, logits.numpy())

    # Round trip: the file's weights in a fresh model give bit-identical logits.
    h, loaded, checksum2 = lm_format.read_eflm(wpath)
    assert checksum2 == checksum
    for k in HEADER_KEYS:
        want = cfg[k] if k not in ("rope_base", "norm_eps") else float(torch.tensor(cfg[k]))
        if h[k] != want:
            raise RuntimeError(f"header {k}: {h[k]} != {want}")
    fresh = LM(dict(cfg, **{k: h[k] for k in lm_format.HEADER_U32}))
    use_attention(fresh, cfg.get("attention", "softmax"))
    load_format_tensors(fresh, loaded)
    if model.kep is not None:
        load_kep(fresh, kep_path(wpath))
    for n, p in model.named_format_tensors().items():
        if not torch.equal(fresh.named_format_tensors()[n], p.detach()):
            raise RuntimeError(f"round trip changed tensor {n}")
    if not torch.equal(fixture_logits(fresh, tokens), logits):
        raise RuntimeError("round trip changed the logits")
    ftok, flog = lm_format.read_fixture(fpath)
    if ftok.tolist() != tokens or not torch.equal(torch.from_numpy(flog), logits):
        raise RuntimeError("fixture round trip mismatch")
    log(f"{name}: wrote {wpath} ({os.path.getsize(wpath)} bytes, FNV-1a {checksum:#018x}) and "
        f"{fpath} ({os.path.getsize(fpath)} bytes); round trip bit-identical")
    with open(wpath, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    return checksum, sha


def loaded_blas():
    """Path of the BLAS library mapped into this process (reference or OpenBLAS)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "blas" in line:
                    return os.path.realpath(line.split()[-1])
    except OSError:
        pass
    return "unknown"


def update_reference(out_dir, name, entry, heldout_sha):
    path = os.path.join(out_dir, "reference.json")
    ref = {}
    if os.path.exists(path):
        with open(path) as f:
            ref = json.load(f)
    ref["heldout_sha256"] = heldout_sha
    ref["heldout_bytes"] = HELDOUT_BYTES
    ref[name] = entry
    with open(path + ".tmp", "w") as f:
        json.dump(ref, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def prepare_data(out_dir, log):
    """Build the text, split it, write and check data/heldout.txt. Returns (train, heldout, sha)."""
    text = build_text()
    train_bytes, heldout = text[:-HELDOUT_BYTES], text[-HELDOUT_BYTES:]
    sha = hashlib.sha256(heldout).hexdigest()
    ref_path = os.path.join(out_dir, "reference.json")
    if os.path.exists(ref_path):
        with open(ref_path) as f:
            expected = json.load(f).get("heldout_sha256")
        if expected and expected != sha:
            raise RuntimeError(f"the held-out text's SHA-256 {sha} differs from reference.json's "
                               f"{expected}: the bible-kjv text changed")
    hpath = os.path.join(out_dir, "data", "heldout.txt")
    os.makedirs(os.path.dirname(hpath), exist_ok=True)
    with open(hpath, "wb") as f:
        f.write(heldout)
    log(f"text {len(text)} bytes: train {len(train_bytes)}, held-out {len(heldout)} "
        f"(SHA-256 {sha})")
    return train_bytes, heldout, sha


def run(kind, args, train_bytes, heldout, heldout_sha, log):
    cfg = dict(CONFIGS[kind])
    if kind not in ATTENTION_MODELS[args.attention]:
        raise SystemExit(f"train.py: --attention {args.attention} cannot train the {kind} "
                         f"(it trains: {', '.join(ATTENTION_MODELS[args.attention])})")
    name = output_name(kind, args.attention, args.seed_offset)
    if args.attention != "softmax":
        cfg["attention"] = args.attention
    if args.attention == "kep_svgp":
        cfg["kep_svgp"] = dict(KEP_SVGP)
    if args.seed_offset:
        cfg["seed"] += args.seed_offset
        cfg["data_seed"] += args.seed_offset
    if args.smoke:
        cfg.update(steps=3, warmup=1, batch=1)
    if args.repeats and kind == "decoder":
        cfg["repeats"] = REPEATS
    for key in ("context", "batch"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.steps is not None:
        cfg["steps"] = args.steps
        cfg["warmup"] = min(cfg["warmup"], max(1, args.steps // 10))
    cfg["_train_bytes"] = train_bytes
    log(f"{name}: training {cfg['steps']} steps of {cfg['batch']} x {cfg['context']} bytes")
    model, final_loss, seconds = train(name, cfg, log)
    log(f"{name}: trained in {seconds:.0f}s, final train loss {final_loss:.4f} nats "
        f"({final_loss / math.log(2):.4f} bits)")
    del cfg["_train_bytes"]
    model.cfg = cfg
    round_to_fp16(model)
    t0 = time.time()
    full, first4 = {}, {}
    for C in cfg.get("eval_contexts", EVAL_CONTEXTS):
        pairs = heldout_bits(model, heldout, C)
        full[str(C)], first4[str(C)] = bpb(pairs), bpb(pairs[:4])
        log(f"{name}: held-out bpb at {C}: {full[str(C)]:.5f} (first 4 windows "
            f"{first4[str(C)]:.5f})")
    eval_seconds = time.time() - t0
    checksum, sha = export(name, model, heldout, args.out, log)
    entry = {
        "config": {k: cfg[k] for k in HEADER_KEYS},
        "training": {k: cfg[k] for k in ("batch", "context", "lr", "min_lr_ratio", "betas",
                                         "weight_decay", "grad_clip", "init_std", "warmup",
                                         "attn_blocks", "mask_prob", "repeats")
                     if k in cfg},
        "tokens_per_step": cfg["batch"] * cfg["context"],
        "precision": "bf16 autocast (oneDNN) matmuls, float32 weights/softmax/norms/loss; "
                     "weights rounded to fp16 after training; references in float32",
        "seeds": {"torch_manual_seed": cfg["seed"], "data_generator": cfg["data_seed"]},
        "steps": cfg["steps"],
        "smoke": bool(args.smoke),
        "train_seconds": round(seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "final_train_loss": final_loss,
        "final_train_loss_unit": "nats per predicted byte, mean of the last 20 steps"
                                 + (" (masked positions only)" if kind == "encoder" else ""),
        "attention": {"name": args.attention,
                      "effattn_method": model.effattn_method,
                      "options": model.effattn_options,
                      **({"kep_svgp": cfg["kep_svgp"]} if "kep_svgp" in cfg else {})},
        "final_train_bpb": final_loss / math.log(2),
        "heldout_bpb": full,
        "heldout_bpb_first4": first4,
        "heldout_sha256": heldout_sha,
        "weights_fnv1a64": f"{checksum:#018x}",
        "weights_sha256": sha,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "blas": loaded_blas(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    update_reference(args.out, name, entry, heldout_sha)
    log(f"{name}: reference.json updated")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("decoder", "encoder", "all"), required=True)
    ap.add_argument("--out", help="output directory (default: this directory; with --smoke "
                                  f"{SMOKE_OUT})")
    ap.add_argument("--smoke", action="store_true", help="3 steps of batch 1: a pipeline test")
    ap.add_argument("--steps", type=int, help="override the step count")
    ap.add_argument("--repeats", action="store_true",
                    help="decoder: train on windows with repeated passages (REPEATS)")
    ap.add_argument("--context", type=int, help="override the training context")
    ap.add_argument("--batch", type=int, help="override the batch")
    ap.add_argument("--attention", choices=tuple(ATTENTION), default="softmax",
                    help="train with this effattn method (through effattn.torch) instead of "
                         "torch's softmax attention; writes weights/<model>-<attention>.eflm")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="add this to the model's init and data seeds (seed noise); writes "
                         "<name>-seed<offset + 1>")
    args = ap.parse_args()
    if args.out is None:
        args.out = SMOKE_OUT if args.smoke else HERE
    torch.set_num_threads(THREADS)

    def log(msg):
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    blas = loaded_blas()
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, BLAS {blas}")
    train_bytes, heldout, sha = prepare_data(args.out, log)
    for name in (("decoder", "encoder") if args.model == "all" else (args.model,)):
        run(name, args, train_bytes, heldout, sha, log)
    write_status("done")


if __name__ == "__main__":
    main()
