"""Run the validation grid: measure (gpuops.memory_budget meter; profiler cross-check on every k-th case) vs formula."""
import sys, json, itertools, time, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import measure_peak, model_factory_for, optimizer_factory_for
from formula import predict_peak

CONFIGS = {
    "llama-A": dict(kind="llama", h=64, L=2, a=4, kv=2, i=172, V=1000, tied=False),
    "llama-B": dict(kind="llama", h=128, L=3, a=8, kv=2, i=344, V=4000, tied=True),
    "llama-C": dict(kind="llama", h=256, L=2, a=8, kv=4, i=688, V=8000, tied=False),
    "gpt2-A": dict(kind="gpt2", h=64, L=2, a=4, V=1000, tied=True),
    "gpt2-B": dict(kind="gpt2", h=128, L=4, a=8, V=4000, tied=False),
    "gpt2-C": dict(kind="gpt2", h=256, L=2, a=4, V=8000, tied=True),
}
SHAPES = [(1, 32), (4, 128), (8, 256)]
OPTS = ["adamw", "adamw-foreach", "adamw-fused", "sgd", "sgd-momentum"]


def grid(which="main"):
    cases = []
    k = 0
    if which in ("main", "all"):
        for (cn, cfg), (b, s), prec, attn, ck in itertools.product(CONFIGS.items(), SHAPES, ["fp32", "bf16-mixed", "bf16"], ["sdpa", "eager"], [False, True]):
            cases.append((cn, b, s, prec, OPTS[k % len(OPTS)], ck, attn, 0.0)); k += 1
    if which in ("extra", "all"):
        for cn in ["llama-A", "gpt2-B"]:
            for opt in OPTS:
                for prec in ["fp32", "bf16"]:
                    cases.append((cn, 1, 32, prec, opt, False, "sdpa", 0.0))
                    cases.append((cn, 4, 128, prec, opt, False, "sdpa", 0.0))
        for cn in ["gpt2-A", "gpt2-B"]:
            for (b, s), prec, attn, ck in itertools.product([(1, 32), (4, 128)], ["fp32", "bf16-mixed", "bf16"], ["sdpa", "eager"], [False, True]):
                cases.append((cn, b, s, prec, "adamw", ck, attn, 0.1))
        for cn in ["llama-B", "gpt2-B"]:
            for ck in [False, True]:
                cases.append((cn, 4, 128, "fp16-mixed", "adamw", ck, "sdpa", 0.0))
    return cases


def run(cases, out_path, xcheck_every=7):
    rows = []
    with open(out_path, "w") as f:
        for n, (cn, b, s, prec, opt, ck, attn, drop) in enumerate(cases):
            cfg = dict(CONFIGS[cn]); kind = cfg.pop("kind")
            if drop:
                cfg["dropout"] = drop
            t = time.time()
            try:
                m = measure_peak(model_factory_for(kind, cfg, attn), optimizer_factory_for(opt), b, s, prec, ck, meter="gpuops")
            except Exception as ex:  # report and go on
                f.write(json.dumps(dict(case=[cn, b, s, prec, opt, ck, attn, drop], error=repr(ex))) + "\n"); f.flush()
                continue
            prof = None
            if xcheck_every and n % xcheck_every == 0:
                prof = measure_peak(model_factory_for(kind, cfg, attn), optimizer_factory_for(opt), b, s, prec, ck, meter="profiler")["peak"]
            p = predict_peak(dict(cfg, kind=kind), b, s, prec, opt, ck, attn)
            row = dict(case=[cn, b, s, prec, opt, ck, attn, drop], measured=m["peak"], measured_phase=m["peak_phase"],
                       profiler=prof, predicted=p["peak"], predicted_where=p["where"],
                       rel_err=(p["peak"] - m["peak"]) / m["peak"], secs=round(time.time() - t, 2),
                       phases={k: v for k, v in m["phases"].items()}, after_build=m["after_build"])
            rows.append(row)
            f.write(json.dumps(row) + "\n"); f.flush()
    return rows


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "main"
    cases = grid(which)
    if len(sys.argv) > 3:
        cases = cases[int(sys.argv[2]):int(sys.argv[3])]
    out = f"/work/main/bench/estimator_validation/results_{which}" + (f"_{sys.argv[2]}_{sys.argv[3]}" if len(sys.argv) > 3 else "") + ".jsonl"
    rows = run(cases, out)
    errs = [abs(r["rel_err"]) for r in rows]
    print(f"{len(rows)} cases, max |err| {max(errs):.4f}, mean {sum(errs)/len(errs):.4f}, >5%: {sum(e > 0.05 for e in errs)}")
