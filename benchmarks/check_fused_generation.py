"""Fused against transient VecInfer decode through a whole generation, from a short prompt: the
window fills during decode (the fused kernels then see a float32 window-plus-new block) before
the ring turns (model-dtype window and new token), so every input dtype set the kernels take
occurs in one process. Random-weight model (greedy tokens from the transient path feed both).

    python benchmarks/check_fused_generation.py \
        --random-weights benchmarks/configs/smollm2-135m.json

With `--model` (and `--artifact-dir`, a calibrated bundle: d2b6 keys around a RoPE-rotated
mean, so the kernels' phase term runs), the same on real weights:

    python benchmarks/check_fused_generation.py --model artifacts/smollm2-135m/model \
        --artifact-dir artifacts/smollm2-135m/bundle
"""

from __future__ import annotations

import argparse

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from veloxquant import KVCacheConfig, make_cache
from veloxquant.codes import unpack_codes
from veloxquant.methods.vecinfer import kernels as K
from veloxquant.model_import import load_model
from _common import random_weights_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--random-weights", metavar="CONFIG_JSON")
    which.add_argument(
        "--model", metavar="MODEL_DIR", help="real weights (veloxquant import-model)"
    )
    p.add_argument(
        "--artifact-dir", help="a calibration bundle (with --model; default: uncalibrated d4b8)"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", type=int, nargs="+", default=[8, 40])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument(
        "--slice-updates",
        action="store_true",
        help="update the fused caches by MLX operations instead of in place (WRITE_IN_PLACE off)",
    )
    p.add_argument(
        "--cuda-cores", action="store_true", help="coded tokens on the CUDA cores (MMA off)"
    )
    args = p.parse_args()
    K.WRITE_IN_PLACE = not args.slice_updates
    K.MMA = not args.cuda_cores
    if args.model:
        model, _ = load_model(args.model)
        model.set_dtype(getattr(mx, args.dtype))
    else:
        model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    if args.artifact_dir:
        config = KVCacheConfig(method="vecinfer", artifact_dir=args.artifact_dir)
    else:
        config = KVCacheConfig(method="vecinfer", uncalibrated=True)
    worst = 0.0
    for n in args.prompt:
        ref, fused = make_cache(model, config), make_cache(model, config)
        for c in ref:
            c.fused = False
        prompt = mx.random.randint(0, 1000, (1, n), key=mx.random.key(n))
        la, lb = model(prompt, cache=ref)[:, -1], model(prompt, cache=fused)[:, -1]
        diffs, same, margins = [], 0, []
        for _ in range(args.steps):
            diffs.append(float(mx.abs(la.astype(mx.float32) - lb.astype(mx.float32)).max()))
            tok = mx.argmax(la, axis=-1)
            if mx.array_equal(tok, mx.argmax(lb, axis=-1)).item():
                same += 1
            else:  # how near a tie the transient path's top two logits were
                top2 = mx.topk(la.astype(mx.float32)[0], 2)
                margins.append(round(float(mx.abs(top2[1] - top2[0]).item()), 4))
            la = model(tok[:, None], cache=ref)[:, -1]
            lb = model(tok[:, None], cache=fused)[:, -1]
        paths = {c.last_attention for c in fused}
        scale = float(mx.abs(la.astype(mx.float32)).max())
        print(
            f"prompt {n}: {args.steps} steps, fused path {paths}, same argmax {same}/"
            f"{args.steps}, max |logit diff| {max(diffs):.4g} (max |logit| {scale:.3g}), "
            f"first steps {[round(d, 3) for d in diffs[:4]]}, last {round(diffs[-1], 3)}"
            + (
                f"; where the argmax differs, the transient top-2 margin {margins}"
                if margins
                else ""
            )
        )
        # what the caches hold afterwards (the fused path wrote codes and window in place):
        # the same tokens coded, codes equal but for float32 near-ties, the same window
        agree, win = [], 0.0
        for r, f in zip(ref, fused, strict=True):
            assert r.compressed_tokens == f.compressed_tokens and r.offset == f.offset
            for side in ("key", "value"):
                if getattr(r, f"{side}_codes") is None:  # nothing has left the window yet
                    continue
                bits, sub = getattr(r, f"{side}_bits"), getattr(r, f"{side}_sub_dim")
                m = r.smooth.shape[-1] // sub
                a, b = (unpack_codes(getattr(c, f"{side}_codes"), bits, m) for c in (r, f))
                agree.append(float(mx.mean(a == b).item()))
            for side in ("window_keys", "window_values"):
                d = getattr(r, side).astype(mx.float32) - getattr(f, side).astype(mx.float32)
                win = max(win, float(mx.abs(d).max()))
        print(
            f"  caches: {fused[0].compressed_tokens} coded tokens per layer, codes agree "
            f"{min(agree, default=1.0):.4f} (worst layer and side), max |window diff| {win:.3g}"
        )
        worst = max(worst, max(diffs) / max(scale, 1e-6))
    print(f"worst relative logit difference {worst:.3g}")


if __name__ == "__main__":
    main()
