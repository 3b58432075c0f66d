"""Recompute predictions with the current formula.py for results_*.jsonl and print a markdown table + stats."""
import json, sys, os, glob
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from formula import predict_peak
from run_grid import CONFIGS

rows = []
for fn in ["results_main.jsonl", "results_extra.jsonl"]:
    for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), fn)):
        r = json.loads(l)
        if "error" in r:
            print("ERROR", r); continue
        cn, b, s, prec, opt, ck, attn, drop = r["case"]
        cfg = dict(CONFIGS[cn])
        if drop: cfg["dropout"] = drop
        p = predict_peak(cfg, b, s, prec, opt, ck, attn)
        rows.append((fn.split("_")[1].split(".")[0], r, p, (p["peak"] - r["measured"]) / r["measured"]))
errs = [abs(x[3]) for x in rows]
xc = [r for _, r, _, _ in rows if r.get("profiler") is not None]
print(f"cases {len(rows)}; |rel err| max {max(errs)*100:.2f}%, mean {sum(errs)/len(errs)*100:.3f}%, median {sorted(errs)[len(errs)//2]*100:.4f}%; "
      f">1%: {sum(e>0.01 for e in errs)}, >2%: {sum(e>0.02 for e in errs)}, >5%: {sum(e>0.05 for e in errs)}; "
      f"profiler cross-checks {len(xc)}, byte-exact {sum(r['profiler']==r['measured'] for r in xc)}\n")
print("| grid | config | b | s | precision | optimizer | ckpt | attn | dropout | measured | phase | predicted | predicted at | err % |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for g, r, p, e in rows:
    cn, b, s, prec, opt, ck, attn, drop = r["case"]
    print(f"| {g} | {cn} | {b} | {s} | {prec} | {opt} | {'y' if ck else ''} | {attn} | {drop or ''} | {r['measured']} | {r['measured_phase']} | {p['peak']} | {p['where']} | {e*100:+.2f} |")
