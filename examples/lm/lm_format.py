"""Readers and writers for the effattn-lm files described in FORMAT.md (this directory).

* ``.eflm`` weight files: header, fp16 tensors, FNV-1a 64 checksum, end marker.
* ``.bin`` logit fixtures: tokens and float32 logits.
* ``splitmix64`` and the encoder's evaluation mask rule.

Pure Python plus numpy (a dependency of Debian's python3-torch); no torch here, so the files can
be inspected without it:

    /usr/bin/python3 examples/lm/lm_format.py examples/lm/weights/decoder.eflm

prints the header and the tensor shapes after verifying names, shapes, checksum and end marker.
"""

import struct
import sys

import numpy as np

WEIGHT_MAGIC = b"EFLMWTS1"
END_MARKER = b"EFLMEND\0"
FIXTURE_MAGIC = b"EFLMFIX1"
VERSION = 1
DTYPE_FP16 = 1
KIND_DECODER = 0
KIND_ENCODER = 1
NO_MASK_TOKEN = 0xFFFFFFFF

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1

# The u32 header fields after magic and version, in file order.
HEADER_U32 = ("kind", "vocab", "d_model", "layers", "heads", "kv_heads", "head_dim", "d_ff",
              "context", "mask_token")


def fnv1a64(data):
    """FNV-1a 64 of a bytes-like object (offset basis 0xcbf29ce484222325, prime 0x100000001b3)."""
    h = FNV_OFFSET
    for b in bytes(data):
        h = ((h ^ b) * FNV_PRIME) & MASK64
    return h


def splitmix64(x):
    """The splitmix64 finaliser of FORMAT.md (all arithmetic mod 2^64)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def encoder_eval_mask(window, length):
    """Masked positions of evaluation window ``window``: splitmix64(w * 2^32 + t) % 1000 < 150."""
    return [splitmix64((window << 32) + t) % 1000 < 150 for t in range(length)]


def tensor_names(layers):
    """The tensor names in file order."""
    names = ["embed"]
    for l in range(layers):
        names += [f"layers.{l}.{n}" for n in
                  ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w2")]
    names.append("final_norm")
    return names


def tensor_shapes(h):
    """name -> (rows, cols) for header dict ``h`` (1-D tensors are 1 x n)."""
    D, H, G, hd, F = h["d_model"], h["heads"], h["kv_heads"], h["head_dim"], h["d_ff"]
    shapes = {"embed": (h["vocab"], D), "final_norm": (1, D)}
    for l in range(h["layers"]):
        p = f"layers.{l}."
        shapes.update({p + "attn_norm": (1, D), p + "wq": (H * hd, D), p + "wk": (G * hd, D),
                       p + "wv": (G * hd, D), p + "wo": (D, H * hd), p + "mlp_norm": (1, D),
                       p + "w1": (F, D), p + "w2": (D, F)})
    return shapes


def write_eflm(path, header, tensors):
    """Write a weight file.

    header: dict with the HEADER_U32 keys plus ``rope_base`` and ``norm_eps`` (floats).
    tensors: name -> array-like of float values (already fp16-representable or not; they are
    converted to IEEE binary16 here), in any order; the file order is ``tensor_names``.
    Returns the checksum.
    """
    shapes = tensor_shapes(header)
    names = tensor_names(header["layers"])
    if set(names) != set(tensors):
        raise ValueError(f"tensor set mismatch: {sorted(set(names) ^ set(tensors))}")
    out = bytearray(WEIGHT_MAGIC)
    out += struct.pack("<I", VERSION)
    out += struct.pack("<10I", *(header[k] & 0xFFFFFFFF for k in HEADER_U32))
    out += struct.pack("<ff", header["rope_base"], header["norm_eps"])
    out += struct.pack("<II", DTYPE_FP16, len(names))
    for name in names:
        a = np.asarray(tensors[name], dtype=np.float32)
        rows, cols = shapes[name]
        if a.size != rows * cols or (a.ndim == 2 and a.shape != (rows, cols)):
            raise ValueError(f"{name}: shape {a.shape}, expected {(rows, cols)}")
        enc = name.encode("ascii")
        out += struct.pack("<I", len(enc)) + enc + struct.pack("<II", rows, cols)
        out += a.reshape(rows, cols).astype("<f2").tobytes()
    checksum = fnv1a64(out)
    out += struct.pack("<Q", checksum) + END_MARKER
    with open(path, "wb") as f:
        f.write(out)
    return checksum


def read_eflm(path):
    """Read and verify a weight file.

    Returns (header dict, {name: float32 numpy array of shape (rows, cols)}, checksum).
    Raises ValueError on a wrong magic, version, dtype, tensor name, shape, checksum or end
    marker, or trailing bytes.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != WEIGHT_MAGIC:
        raise ValueError("bad magic")
    pos = 8
    (version,) = struct.unpack_from("<I", data, pos)
    pos += 4
    if version != VERSION:
        raise ValueError(f"unsupported version {version}")
    h = dict(zip(HEADER_U32, struct.unpack_from("<10I", data, pos)))
    pos += 40
    h["rope_base"], h["norm_eps"] = struct.unpack_from("<ff", data, pos)
    pos += 8
    dtype, n_tensors = struct.unpack_from("<II", data, pos)
    pos += 8
    if dtype != DTYPE_FP16:
        raise ValueError(f"unsupported dtype {dtype}")
    names = tensor_names(h["layers"])
    shapes = tensor_shapes(h)
    if n_tensors != len(names):
        raise ValueError(f"{n_tensors} tensors, expected {len(names)}")
    tensors = {}
    for expected in names:
        (name_len,) = struct.unpack_from("<I", data, pos)
        pos += 4
        name = data[pos:pos + name_len].decode("ascii")
        pos += name_len
        if name != expected:
            raise ValueError(f"tensor {name!r}, expected {expected!r}")
        rows, cols = struct.unpack_from("<II", data, pos)
        pos += 8
        if (rows, cols) != shapes[name]:
            raise ValueError(f"{name}: {rows} x {cols}, expected {shapes[name]}")
        n = rows * cols
        tensors[name] = np.frombuffer(data, dtype="<f2", count=n, offset=pos) \
            .astype(np.float32).reshape(rows, cols)
        pos += 2 * n
    (checksum,) = struct.unpack_from("<Q", data, pos)
    if checksum != fnv1a64(data[:pos]):
        raise ValueError("checksum mismatch")
    pos += 8
    if data[pos:pos + 8] != END_MARKER:
        raise ValueError("missing end marker")
    if pos + 8 != len(data):
        raise ValueError("trailing bytes after the end marker")
    return h, tensors, checksum


def write_fixture(path, tokens, logits):
    """Write a logit fixture: tokens (T ints), logits (T x vocab float32)."""
    logits = np.ascontiguousarray(logits, dtype="<f4")
    T, vocab = logits.shape
    if len(tokens) != T:
        raise ValueError("token / logit row count mismatch")
    with open(path, "wb") as f:
        f.write(FIXTURE_MAGIC + struct.pack("<II", T, vocab))
        f.write(np.asarray(tokens, dtype="<u4").tobytes())
        f.write(logits.tobytes())


def read_fixture(path):
    """Read a logit fixture: returns (tokens uint32 array, logits float32 T x vocab array)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != FIXTURE_MAGIC:
        raise ValueError("bad fixture magic")
    T, vocab = struct.unpack_from("<II", data, 8)
    if len(data) != 16 + 4 * T + 4 * T * vocab:
        raise ValueError("fixture size mismatch")
    tokens = np.frombuffer(data, dtype="<u4", count=T, offset=16).copy()
    logits = np.frombuffer(data, dtype="<f4", count=T * vocab, offset=16 + 4 * T) \
        .reshape(T, vocab).copy()
    return tokens, logits


if __name__ == "__main__":
    for p in sys.argv[1:]:
        if p.endswith(".bin"):
            tok, lg = read_fixture(p)
            print(f"{p}: fixture T={len(tok)} vocab={lg.shape[1]} tokens[:16]={tok[:16].tolist()}")
            continue
        hdr, ts, cs = read_eflm(p)
        print(f"{p}: checksum {cs:#018x} OK")
        print("  " + ", ".join(f"{k}={v}" for k, v in hdr.items()))
        print(f"  {len(ts)} tensors, {sum(t.size for t in ts.values())} parameters")
