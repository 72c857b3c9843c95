"""GPU check of the Triton paged-attention kernels: correctness against kernels.reference, then
timing against torch SDPA (flash backend, padded dense K/V) for decode and prefill shapes.

    python -m benchmarks.triton_kernels --quick      # ~5 min on one GPU; prints a table, exits 1 on a mismatch

Decode reports achieved bandwidth (K/V bytes read / time); prefill reports TFLOP/s and the ratio to
SDPA. Without CUDA it says so, runs a tiny correctness pass under the Triton interpreter, exits 0.
"""

import argparse
import functools
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.testing  # noqa: E402

from conveyor.kernels import reference, triton_ops  # noqa: E402

MODELS = {  # name: (num_heads, num_kv_heads, head_dim)
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen2.5-1.5b": (12, 2, 128),
    "llama3.1-8b": (32, 8, 128),
}
DECODE_QUICK = [(1, 32768), (32, 4096), (256, 1024)]
DECODE_FULL = [(b, c) for b in (1, 16, 64, 256) for c in (512, 4096, 32768) if b * c <= 256 * 8192]
PREFILL_QUICK = [(1, 4096, 0), (8, 1024, 0), (4, 512, 3584)]  # (seqs, new tokens, cached tokens)
PREFILL_FULL = PREFILL_QUICK + [(1, 16384, 0), (32, 512, 0), (1, 2048, 30720), (16, 256, 1792)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_cache(
    num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_seq = -(-seq_len // block_size)
    shape = (num_seqs * per_seq, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, dtype=dtype, device=device)
    v = torch.randn(shape, dtype=dtype, device=device)
    ids = torch.randperm(num_seqs * per_seq, device=device).to(torch.int32)
    return k, v, ids.view(num_seqs, per_seq)


def dense(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    blocks = cache[block_tables.long()]
    b, nb, bs, kvh, d = blocks.shape
    return blocks.view(b, nb * bs, kvh, d)[:, :seq_len].transpose(1, 2).contiguous()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error relative to the output's scale: long contexts average values towards 0."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def check(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    err = rel_err(got, want)
    print(f"  {'ok ' if err <= TOL[dtype] else 'BAD'} {name:<48} max|err|/max|ref| {err:.2e}")
    return err <= TOL[dtype]


def correctness(device: str, dtypes: list[torch.dtype], scale_up: int) -> bool:
    ok = True
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        for (h, kvh, d), bs in [((4, 2, 32), 16), ((8, 2, 64), 32)] + ([((32, 8, 128), 16)] if scale_up > 1 else []):
            lens = [1, bs - 1, bs + 1, 40 * scale_up + 3]
            k, v, bt = paged_cache(len(lens), max(lens), kvh, d, bs, dtype, device)
            sl = torch.tensor(lens, dtype=torch.int32, device=device)
            q = torch.randn(len(lens), h, d, dtype=dtype, device=device)
            want = reference.paged_decode_attention(q.float(), k.float(), v.float(), bt, sl, d**-0.5)
            for splits in (1, 4, None):
                got = triton_ops.paged_decode_attention(q, k, v, bt, sl, d**-0.5, num_splits=splits)
                ok &= check(f"decode {dtype} h{h}/kv{kvh} d{d} bs{bs} splits={splits}", got, want, dtype)
            q_lens = torch.tensor([1, bs + 1, 17 * scale_up, 0], device=device)
            qsl = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)]).to(torch.int32)
            sl = torch.tensor(lens, device=device).clamp_min(q_lens).to(torch.int32)
            q = torch.randn(int(qsl[-1]), h, d, dtype=dtype, device=device)
            args = (bt, sl, qsl, int(q_lens.max()), d**-0.5)
            got = triton_ops.paged_prefill_attention(q, k, v, *args)
            want = reference.paged_prefill_attention(q.float(), k.float(), v.float(), *args)
            ok &= check(f"prefill {dtype} h{h}/kv{kvh} d{d} bs{bs}", got, want, dtype)
            slots = torch.randperm(k.shape[0] * bs, generator=gen, device=device)[:7]
            slots[2] = -1
            new_k, new_v = torch.randn(2, 7, kvh, d, dtype=dtype, device=device)
            kt, vt, kr, vr = k.clone(), v.clone(), k.clone(), v.clone()
            triton_ops.store_kv_cache(new_k, new_v, kt, vt, slots)
            reference.store_kv_cache(new_k, new_v, kr, vr, slots)
            same = torch.equal(kt, kr) and torch.equal(vt, vr)
            print(f"  {'ok ' if same else 'BAD'} store_kv_cache {dtype} bs{bs}")
            ok &= same
    return ok


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Best flash call for [B, h, L, d] q over [B, kvh, S, d] k/v: native GQA, else expanded heads."""
    from torch.nn.attention import SDPBackend, bias, sdpa_kernel

    mask = bias.causal_lower_right(q.shape[2], k.shape[2]) if causal and q.shape[2] != k.shape[2] else None
    is_causal = causal and mask is None

    def call(kk: torch.Tensor, vv: torch.Tensor, gqa: bool):
        def fn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, kk, vv, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
                )

        return fn

    try:
        fn = call(k, v, True)
        fn()
        return fn, "flash"
    except (RuntimeError, ValueError, NotImplementedError):
        group = q.shape[1] // k.shape[1]
        return call(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False), "flash(expanded kv)"


def bench_decode(shapes: list, models: list, dtype: torch.dtype, hbm_tbps: float, device: str = "cuda") -> bool:
    print(f"\ndecode ({dtype}, block 16): bandwidth = K/V bytes read / time; target >= 70% of {hbm_tbps} TB/s")
    print(
        f"{'model':<14}{'batch':>6}{'ctx':>7}{'splits':>7}{'triton us':>11}{'TB/s':>7}{'%HBM':>6}"
        f"{'sdpa us':>10}{'vs sdpa':>9}  sdpa"
    )
    ok = True
    for name in models:
        h, kvh, d = MODELS[name]
        for batch, ctx in shapes:
            k, v, bt = paged_cache(batch, ctx, kvh, d, 16, dtype, device)
            sl = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, h, d, dtype=dtype, device=device)
            splits = triton_ops._default_num_splits(batch, kvh, ctx, q.device)
            run = functools.partial(triton_ops.paged_decode_attention, q, k, v, bt, sl, d**-0.5, ctx)
            ms = triton.testing.do_bench(run, return_mode="median")
            tbps = 2 * batch * ctx * kvh * d * k.element_size() / (ms * 1e-3) / 1e12
            kd, vd = dense(k, bt, ctx), dense(v, bt, ctx)
            fn, label = sdpa(q[:, :, None], kd, vd, False, d**-0.5)
            sdpa_ms = triton.testing.do_bench(fn, return_mode="median")
            err = rel_err(run(), fn()[:, :, 0])
            ok &= err <= TOL[dtype]
            print(
                f"{name:<14}{batch:>6}{ctx:>7}{splits:>7}{ms * 1e3:>11.1f}{tbps:>7.2f}"
                f"{100 * tbps / hbm_tbps:>5.0f}%{sdpa_ms * 1e3:>10.1f}{err:>9.1e}  {label}"
            )
            del k, v, kd, vd
            torch.cuda.empty_cache()
    return ok


def bench_prefill(shapes: list, models: list, dtype: torch.dtype, device: str = "cuda") -> bool:
    print(f"\nprefill ({dtype}, block 16): causal over cached prefix; target triton/sdpa <= 1.3")
    print(
        f"{'model':<14}{'seqs':>5}{'new':>7}{'cached':>8}{'triton ms':>11}{'TFLOP/s':>9}"
        f"{'sdpa ms':>9}{'ratio':>7}{'vs sdpa':>9}  sdpa"
    )
    ok = True
    for name in models:
        h, kvh, d = MODELS[name]
        for seqs, new, cached in shapes:
            total = new + cached
            k, v, bt = paged_cache(seqs, total, kvh, d, 16, dtype, device)
            sl = torch.full((seqs,), total, dtype=torch.int32, device=device)
            qsl = torch.arange(seqs + 1, dtype=torch.int32, device=device) * new
            q = torch.randn(seqs * new, h, d, dtype=dtype, device=device)
            run = lambda: triton_ops.paged_prefill_attention(q, k, v, bt, sl, qsl, new, d**-0.5, total)  # noqa
            ms = triton.testing.do_bench(run, return_mode="median")
            flops = 4 * seqs * h * d * (new * cached + new * (new + 1) // 2)
            qd = q.view(seqs, new, h, d).transpose(1, 2)
            fn, label = sdpa(qd, dense(k, bt, total), dense(v, bt, total), True, d**-0.5)
            sdpa_ms = triton.testing.do_bench(fn, return_mode="median")
            err = rel_err(run(), fn().transpose(1, 2).reshape(seqs * new, h, d))
            ok &= err <= TOL[dtype]
            print(
                f"{name:<14}{seqs:>5}{new:>7}{cached:>8}{ms:>11.3f}{flops / (ms * 1e-3) / 1e12:>9.1f}"
                f"{sdpa_ms:>9.3f}{ms / sdpa_ms:>7.2f}{err:>9.1e}  {label}"
            )
            del k, v
            torch.cuda.empty_cache()
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and models (~5 min)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM bandwidth (H200: 4.8)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("CUDA not available: no timings. Tiny correctness pass under the Triton interpreter:")
        ok = correctness("cpu", [torch.float32, torch.bfloat16], scale_up=1)
        print("interpreter correctness:", "PASS" if ok else "FAIL")
        return 0 if ok else 1
    print(f"device: {torch.cuda.get_device_name()}")
    ok = correctness("cuda", [torch.float16, torch.bfloat16], scale_up=8)
    print("correctness:", "PASS" if ok else "FAIL")
    if not ok:
        return 1
    dtype = getattr(torch, args.dtype)
    models = ["qwen2.5-0.5b", "llama3.1-8b"] if args.quick else list(MODELS)
    ok = bench_decode(DECODE_QUICK if args.quick else DECODE_FULL, models, dtype, args.hbm_tbps)
    ok &= bench_prefill(PREFILL_QUICK if args.quick else PREFILL_FULL, models, dtype)
    print("large-shape agreement with sdpa:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
