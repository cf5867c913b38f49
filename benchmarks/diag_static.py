"""Diagnostic for the H200: generate(cache_implementation="static") after oxygen_torch.enable()
hit a device-side assert (bench_generate.py, mode oxygen_static, 2026-11-29). Runs the same call
(Llama-1.1B shape cut to 2 layers, bf16, B=16 P=512, 32 new tokens) in one fresh process per
variant, to see which part of enable() is involved:

  stock       no oxygen at all (the reference tokens)
  notrees     no oxygen, inductor's CUDA-graph trees off (what enable() sets)
  allocator   only the pool as PyTorch's allocator (global route), CUDA_LAUNCH_BLOCKING=1
  hf          only the transformers integration, torch's own allocator
  enable      oxygen_torch.enable() (both)
  enable_nocg enable(), compile_config mode="default" (no CUDA graphs)
  enable_inductor  enable(), compile_config=CompileConfig(): the user's own Inductor
              reduce-overhead, whose non-tree CUDA graphs enable() routes to oxygen's runner

    python benchmarks/diag_static.py [variant ...]
"""

import json
import os
import subprocess
import sys
import traceback

VARIANTS = ("stock", "notrees", "allocator", "hf", "enable", "enable_nocg", "enable_inductor")


def child(variant: str) -> dict:
    import torch

    if variant == "notrees":
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraph_trees = False
    if variant in ("allocator", "enable", "enable_nocg", "enable_inductor"):
        import oxygen_torch

        if variant == "allocator":
            from oxygen_torch import pool as allocator

            allocator.enable_allocator(oxygen_torch.load_config().pool)
        else:
            oxygen_torch.enable()
    if variant == "hf":
        from oxygen_torch.integrations.hf import integration as hf

        hf.enable_hf()
    from transformers import CompileConfig

    from oxygen_torch.tools.demo_models import LLAMA_1B, random_llama

    model = random_llama(dict(LLAMA_1B, num_hidden_layers=2), init_on_device=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32000, (16, 512), generator=g).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
              do_sample=False, cache_implementation="static")  # fmt: skip
    if variant == "enable_nocg":
        kw["compile_config"] = CompileConfig(mode="default")
    if variant == "enable_inductor":
        kw["compile_config"] = CompileConfig()  # backend inductor, mode reduce-overhead
    with torch.no_grad():
        a = model.generate(ids, **kw)
        b = model.generate(ids, **kw)
    torch.cuda.synchronize()
    return {"variant": variant, "tokens": a[:, 512:].tolist(), "repeat_equal": bool((a == b).all())}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        try:
            print(json.dumps(child(sys.argv[2])), flush=True)
        except Exception:
            print(json.dumps({"variant": sys.argv[2], "error": traceback.format_exc()[-2500:]}))
        return 0
    ref = None
    for v in sys.argv[1:] or VARIANTS:
        env = dict(os.environ)
        if v == "allocator":
            env["CUDA_LAUNCH_BLOCKING"] = "1"
        p = subprocess.run([sys.executable, __file__, "--child", v], capture_output=True,
                           text=True, env=env, timeout=200)  # fmt: skip
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"variant": v, "error": p.stderr[-2500:]}
        if "error" in r:
            print(f"== {v}: ERROR\n{r['error']}", flush=True)
            continue
        ref = ref or r["tokens"]
        print(f"== {v}: ok, repeat equal {r['repeat_equal']}, tokens equal stock "
              f"{r['tokens'] == ref}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
