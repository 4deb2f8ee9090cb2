#!/usr/bin/env python3
"""Write a text with passages repeated verbatim later on, and the spans of the repeats.

    python3 examples/lm/make_repeats.py IN.txt OUT.txt OUT.spans [--context 4096] [--seed 1]
                                        [--every 1024] [--min-len 64] [--max-len 512]

Walks through IN in pieces of about `every` bytes (cut at line ends); after each piece, with the
bytes written so far, it appends a copy of an earlier passage: whole lines totalling
`min_len`..`max_len` bytes, starting at a line start between 64 and context - len - 64 bytes back
(so that a window of `context` bytes that ends at the copy's end holds the original). OUT.spans
gets one `START LENGTH` line per copy (byte offsets into OUT.txt), the format of
`effattn-lm eval --spans`. Deterministic for a given seed. The original text between the copies
is unchanged, so the spans' bytes can only be predicted well by looking the original up.
"""

import argparse
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out_text")
    ap.add_argument("out_spans")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--every", type=int, default=1024)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    a = ap.parse_args()
    if a.max_len + 128 >= a.context:
        raise SystemExit("make_repeats: --max-len must be smaller than --context - 128")
    rng = random.Random(a.seed)
    with open(a.src, "rb") as f:
        src = f.read()
    lines = src.splitlines(keepends=True)
    out = bytearray()
    starts = []  # line starts in out
    spans = []
    piece = 0
    for line in lines:
        starts.append(len(out))
        out += line
        piece += len(line)
        if piece < a.every:
            continue
        piece = 0
        want = rng.randint(a.min_len, a.max_len)
        # Candidate originals: line starts far enough back that the copy and its original fit
        # in one context window, and not inside an earlier copy.
        lo = len(out) - (a.context - a.max_len - 64)
        cands = [s for s in starts if lo <= s <= len(out) - 64 - a.min_len and
                 not any(b <= s < b + n for b, n in spans)]
        if not cands:
            continue
        s = rng.choice(cands)
        end = s
        while end - s < want and end < len(out):
            nl = out.find(b"\n", end)
            end = len(out) if nl < 0 else nl + 1
        end = min(end, s + a.max_len)
        copy = bytes(out[s:end])
        if len(copy) < a.min_len or (len(out) + len(copy)) - s > a.context:
            continue
        spans.append((len(out), len(copy)))
        out += copy
    with open(a.out_text, "wb") as f:
        f.write(out)
    with open(a.out_spans, "w") as f:
        f.write(f"# {len(spans)} repeated passages of {a.src.split('/')[-1]}: START LENGTH "
                f"(context {a.context}, seed {a.seed})\n")
        for b, n in spans:
            f.write(f"{b} {n}\n")
    print(f"make_repeats: {len(out)} bytes, {len(spans)} spans, "
          f"{sum(n for _, n in spans)} repeated bytes")


if __name__ == "__main__":
    main()
