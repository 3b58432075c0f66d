"""Derive the activation coefficients (bytes alive at the end of the forward, above weights/state) by
measuring many tiny configs per mode and solving a linear system over monomials; coefficients come out
as exact small rationals (element sizes), which FINDINGS.md explains tensor by tensor."""
import sys, json, random, itertools
import numpy as np
sys.path.insert(0, '/work/main/bench/estimator_validation')
from measure import measure_peak, model_factory_for, optimizer_factory_for
from formula import autocast_weight_elems

LAYER = ["Nh", "Nkvd", "Ni", "bas2", "bs2", "Na", "N", "one"]
HEAD = ["NV", "Nh", "N", "sd", "bs2", "one"]


def feats(kind, cfg, b, s):
    h, a, L, V = cfg["h"], cfg["a"], cfg["L"], cfg["V"]
    d = h // a
    kv = cfg.get("kv", a)
    i = cfg.get("i") or 4 * h
    N = b * s
    lay = dict(Nh=N * h, Nkvd=N * kv * d, Ni=N * i, bas2=b * a * s * s, bs2=b * s * s, Na=N * a, N=N, one=1)
    hd = dict(NV=N * V, Nh=N * h, N=N, sd=s * d, bs2=b * s * s, one=1)
    return [L * lay[k] for k in LAYER] + [hd[k] for k in HEAD]


def configs(kind, n, seed=0):
    r = random.Random(seed)
    out = []
    for _ in range(n):
        a = r.choice([2, 4])
        d = r.choice([8, 16, 24])
        cfg = dict(h=a * d, L=r.choice([1, 2, 3]), a=a, V=r.choice([300, 500, 700]), n_pos=64)
        cfg["i"] = r.choice([40, 72, 136, 200])
        if kind == "llama":
            cfg["kv"] = r.choice([1, a // 2, a])
        out.append((cfg, r.choice([1, 2, 3]), r.choice([8, 12, 20, 28, 40])))
    return out


def fit_mode(kind, attn, prec, ckpt, dropout=0.0, n=22):
    X, y = [], []
    for cfg, b, s in configs(kind, n):
        if kind == "gpt2":
            cfg["dropout"] = dropout
        r = measure_peak(model_factory_for(kind, cfg, attn), optimizer_factory_for("sgd"), b, s, prec, ckpt,
                         steps=1, meter="counting")
        A = r["phases"]["forward/1"]["end"] - r["after_build"]
        if prec in ("bf16-mixed", "fp16-mixed"):
            A -= 2 * autocast_weight_elems(kind, cfg)  # known: autocast cache copies, saved by the matmuls
        X.append(feats(kind, cfg, b, s)); y.append(A)
    X = np.array(X, float); y = np.array(y, float)
    # drop columns that are identically zero or collinear for this model kind
    cols = list(range(X.shape[1]))
    names = [f"L*{k}" for k in LAYER] + [f"{k}" for k in HEAD]
    coef, res, rank, sv = np.linalg.lstsq(X, y, rcond=None)
    coef_r = np.round(coef * 2) / 2
    pred = X @ coef_r
    err = np.max(np.abs(pred - y))
    return dict(zip(names, coef)), dict(zip(names, coef_r)), err, rank


if __name__ == "__main__":
    modes = json.loads(sys.argv[1])
    for m in modes:
        c, cr, err, rank = fit_mode(*m)
        print(json.dumps(m), "rank", rank, "maxabs_err_rounded", err)
        print("   ", {k: round(v, 3) for k, v in c.items() if abs(v) > 1e-3})
        print("   ", {k: v for k, v in cr.items() if v})
