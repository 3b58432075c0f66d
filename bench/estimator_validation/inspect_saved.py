"""Debug tool: list the tensors autograd saves for backward during one forward (deduplicated by storage),
attributed to the innermost module running when they were saved."""
import contextlib, sys, collections
import torch
from measure import model_factory_for


def inspect(kind, cfg, attn, b, s, precision="fp32", ckpt=False):
    model = model_factory_for(kind, cfg, attn)()
    if precision == "bf16":
        model.to(torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {b_.untyped_storage().data_ptr() for b_ in model.buffers()}
    stack = []
    for name, mod in model.named_modules():
        mod.register_forward_pre_hook(lambda m, a, n=name: stack.append(n))
        mod.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
    seen = {}
    ids = torch.randint(0, cfg["V"], (b, s))
    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in params and key not in seen and st.nbytes() > 0:
            seen[key] = (stack[-1] if stack else "?", tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes(), t.grad_fn.name() if t.grad_fn else "leaf/none")
        return t
    amp = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with (torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext()):
            out = model(input_ids=ids, labels=ids)
    return seen


if __name__ == "__main__":
    import json
    kind = sys.argv[1]; attn = sys.argv[2]; prec = sys.argv[3]
    cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else (dict(h=64, L=1, a=4, kv=2, i=96, V=1000) if kind == "llama" else dict(h=64, L=1, a=4, V=1000))
    b, s = 2, 24
    seen = inspect(kind, cfg, attn, b, s, prec)
    bsh = b * s * cfg["h"]
    tot = 0
    for k, (mod, shape, dt, nb, fn) in seen.items():
        tot += nb
        print(f"{mod:40s} {str(shape):22s} {dt:9s} {nb:8d} {fn}")
    print("total", tot)
