"""Reference implementation of the analytic peak-memory formula (see FINDINGS.md).

predict_peak(config_dict, batch, seq, precision, optimizer, checkpointing, attn) -> dict with
    "peak": predicted peak bytes above the pre-build baseline,
    "where": which candidate moment wins,
    "candidates": {name: bytes},
    "components": {name: bytes}  (weights, buffers, inputs, grads, optimizer state, activations...).

config_dict: {"kind": "llama"|"gpt2", "h", "L", "a", "V", optional "kv" (llama), "i" (intermediate;
gpt2 default 4h), "n_pos" (default 256), "tied" (gpt2 default True, llama default False), "dropout"
(gpt2 only, default 0.0)}. precision: "fp32" | "bf16-mixed" | "fp16-mixed" | "bf16".
optimizer: "adamw" (torch default on CPU = single-tensor for-loop), "adamw-foreach", "adamw-fused",
"adamw-forloop", "sgd", "sgd-momentum". attn: "sdpa" | "eager".
Valid for HF transformers 4.57.3 / torch 2.11 on CPU, use_cache=False, loss = model(...).loss with
labels=input_ids, the ModelOutput (logits) dropped right after the forward.
"""

from __future__ import annotations

RNG_STATE_BYTES = 5056  # torch.get_rng_state() for the CPU generator, saved by each reentrant checkpoint


def _dims(cfg):
    kind = cfg["kind"]
    h, L, a, V = cfg["h"], cfg["L"], cfg["a"], cfg["V"]
    d = h // a
    kv = cfg.get("kv", a) if kind == "llama" else a
    i = cfg.get("i") or (4 * h if kind == "gpt2" else None)
    n_pos = cfg.get("n_pos", 256)
    tied = cfg.get("tied", kind == "gpt2")
    p = cfg.get("dropout", 0.0) if kind == "gpt2" else 0.0
    return kind, h, L, a, V, d, kv, i, n_pos, tied, p


def param_groups(cfg):
    """Parameter element counts by group, and the number of parameter tensors."""
    kind, h, L, a, V, d, kv, i, n_pos, tied, p = _dims(cfg)
    g = {}
    if kind == "llama":
        g["embed"] = V * h
        g["layers.attn"] = L * (2 * h * a * d + 2 * h * kv * d)
        g["layers.mlp"] = L * 3 * h * i
        g["layers.norm"] = L * 2 * h
        g["final_norm"] = h
        g["lm_head"] = 0 if tied else V * h
        n_tensors = 1 + 9 * L + 1 + (0 if tied else 1)
        # weights that autocast casts (and caches) per forward: every Linear weight incl. lm_head
        mm = L * (2 * h * a * d + 2 * h * kv * d + 3 * h * i) + V * h
        mm_bias = 0
    else:
        g["wte"] = V * h
        g["wpe"] = n_pos * h
        g["layers.attn"] = L * (3 * h * h + 3 * h + h * h + h)
        g["layers.mlp"] = L * (h * i + i + i * h + h)
        g["layers.norm"] = L * 4 * h
        g["final_norm"] = 2 * h
        g["lm_head"] = 0 if tied else V * h
        n_tensors = 2 + 12 * L + 2 + (0 if tied else 1)
        mm = L * (3 * h * h + h * h + 2 * h * i) + V * h
        mm_bias = L * (3 * h + h + i + h)
    largest = max(V * h, n_pos * h if kind == "gpt2" else 0, h * i, 3 * h * h if kind == "gpt2" else h * h)
    return g, n_tensors, mm, mm_bias, largest


def _sizes(precision):
    pb = 2 if precision == "bf16" else 4  # parameter / grad / optimizer-state element bytes
    e = 4 if precision == "fp32" else 2  # matmul / activation element bytes (bf16/fp16 under autocast)
    r = 2 if precision == "bf16" else 4  # residual stream / norm dtype
    return pb, e, r


def activations_end_of_forward(cfg, b, s, precision, checkpointing, attn):
    """Bytes alive at the end of the forward beyond weights/inputs/optimizer state (what autograd saved)."""
    kind, h, L, a, V, d, kv, i, n_pos, tied, p = _dims(cfg)
    pb, e, r = _sizes(precision)
    N = b * s
    mixed = precision in ("bf16-mixed", "fp16-mixed")
    bf16 = precision == "bf16"
    Nh, bas2, bs2, bas = N * h, b * a * s * s, b * s * s, b * a * s
    comp = {}
    # ---- head (outside the layers): final norm, lm_head input, log_softmax output, labels, loss
    comp["head.logsoftmax_fp32"] = N * V * 4
    comp["head.labels_int64"] = N * 8
    comp["head.loss"] = 4
    if kind == "llama":
        # RMSNorm: x(fp32 copy), rsqrt(N fp32), normed, output (lm_head input)
        if precision == "fp32":
            comp["head.final_norm"] = 3 * Nh * 4 + N * 4
        elif mixed:
            comp["head.final_norm"] = 2 * Nh * 4 + N * 4 + Nh * 2  # + bf16 cast of its output for lm_head
        else:
            comp["head.final_norm"] = Nh * 4 + N * 4 + 2 * Nh * 2
        comp["head.rope_cos_sin"] = 2 * s * d * (2 if bf16 else 4)
    else:
        # LayerNorm: x, mean, rstd (fp32 under autocast, bf16 in pure bf16), output (lm_head input)
        if precision == "fp32":
            comp["head.final_norm"] = 2 * Nh * 4 + 2 * N * 4
        elif mixed:
            comp["head.final_norm"] = Nh * 4 + 2 * N * 4 + Nh * 2
        else:
            comp["head.final_norm"] = 2 * Nh * 2 + 2 * N * 2
        comp["head.position_ids"] = s * 8
        if p > 0:
            comp["head.embd_dropout_mask"] = Nh * r
    if mixed:
        # autocast weight cache: bf16 copies of the matmul weights, kept alive because mm saves them
        g, nt, mm, mm_bias, largest = param_groups(cfg)
        comp["autocast_weight_copies"] = 2 * (V * h if checkpointing else mm)

    if checkpointing:
        # reentrant checkpoint saves only each layer's inputs: hidden states, the (shared) mask, RNG state
        comp["layers.ckpt_inputs"] = L * (Nh * r + RNG_STATE_BYTES)
        mask_b = 1 if attn == "sdpa" else r  # sdpa: bool mask; eager: additive float mask in the model dtype
        comp["ckpt.mask"] = bs2 * mask_b
        if kind == "llama":
            comp["ckpt.misc"] = s * 8 + 4
        return comp

    per = {}
    if kind == "llama":
        if precision == "fp32":
            per["norms+residual"] = 2 * (3 * Nh * 4 + N * 4)
            per["qkv_in"] = 0
        elif mixed:
            per["norms+residual"] = 2 * (2 * Nh * 4 + N * 4)
            per["qkv_in"] = (3 + 2) * Nh * 2  # bf16 casts of the norm outputs, one per consuming Linear
        else:
            per["norms+residual"] = 2 * (Nh * 4 + N * 4 + 2 * Nh * 2)
            per["qkv_in"] = 0
        per["mlp"] = 4 * N * i * e  # gate, up, silu(gate), silu*up
        if attn == "sdpa":
            per["attn"] = 3 * Nh * e + Nh * e + bs2 * e + bas * 4  # q_rot,k_rep,v_rep, out, float mask, lse
        else:
            soft = bas2 * 4 + (bas2 * 2 if e == 2 else 0)  # fp32 softmax (+ its cast to bf16)
            per["attn"] = 3 * Nh * e + Nh * e + soft  # q,k,v copies for bmm, o_proj input
    else:
        per["norms+residual"] = 2 * (Nh * r + 2 * N * r)  # LN input x and mean/rstd, twice
        if precision == "fp32":
            per["ln_out"] = 2 * Nh * 4
        else:
            per["ln_out"] = 2 * Nh * 2  # (bf16 cast of) LN output saved by c_attn / c_fc
        per["mlp"] = 5 * N * i * e  # c_fc out + gelu_new's 3 intermediates + gelu out
        if p > 0:
            per["dropout_masks"] = 2 * Nh * e  # resid_dropout, mlp dropout (mask in input dtype)
        if attn == "sdpa" and p > 0:
            # dropout>0 sends CPU sdpa to the math path, which upcasts to fp32 and saves the probabilities
            per["attn"] = 3 * Nh * 4 + 3 * bas2 * 4 + Nh * e
        elif attn == "sdpa":
            per["attn"] = 3 * Nh * e + Nh * e + bs2 * e + bas * 4  # c_attn out (q,k,v), out, mask, lse
        else:
            if precision == "fp32":
                soft = bas2 * 4 * (3 if p > 0 else 1)
            elif mixed:
                soft = bas2 * 4 + bas2 * 2 + (bas2 * 2 if p > 0 else 0)  # fp32 softmax, bf16 cast/mask, dropped
                if p > 0:
                    soft = bas2 * 4 + 2 * bas2 * 2
            else:
                soft = bas2 * 2 * (3 if p > 0 else 1)
            per["attn"] = 4 * Nh * e + soft + e  # q,k,v copies, c_proj input, softmax(+mask,+dropped), scale
    for k, v in per.items():
        comp["layers." + k] = L * v
    return comp


def predict_peak(config_dict, batch, seq, precision="fp32", optimizer="adamw", checkpointing=False, attn="sdpa"):
    cfg = dict(config_dict)
    kind, h, L, a, V, d, kv, i, n_pos, tied, p = _dims(cfg)
    pb, e, r = _sizes(precision)
    N = batch * seq
    g, n_tensors, mm, mm_bias, largest = param_groups(cfg)
    P = sum(g.values())
    comp = {}
    comp["weights"] = P * pb
    if kind == "llama":
        comp["buffers"] = (d // 2) * 4 + ((d // 2) * 2 if precision == "bf16" else 0)  # inv_freq (+ fp32 original)
    else:
        comp["buffers"] = L * (n_pos * n_pos + pb)  # causal bool 'bias' + 'masked_bias' scalar per layer
    comp["input_ids"] = N * 8
    W = comp["weights"] + comp["buffers"] + comp["input_ids"]
    G = P * pb
    comp["grads"] = G
    opt = optimizer
    if opt.startswith("adamw"):
        S = 2 * P * pb + 4 * n_tensors  # exp_avg, exp_avg_sq + one fp32 'step' scalar tensor per param
        if opt == "adamw-foreach":
            T = P * pb  # one list of temporaries the size of all params (e.g. _foreach_sqrt(exp_avg_sq))
        elif opt == "adamw-fused":
            T = 0
        else:  # single-tensor for-loop (torch's CPU default): two param-sized temporaries of the largest param
            T = 2 * largest * pb
    elif opt == "sgd-momentum":
        S, T = P * pb, 0
    elif opt == "sgd":
        S, T = 0, 0
    else:
        raise ValueError(opt)
    comp["optimizer_state"] = S
    comp["optimizer_temporaries"] = T
    act = activations_end_of_forward(cfg, batch, seq, precision, checkpointing, attn)
    A = sum(act.values())
    comp["activations_end_of_forward"] = A
    comp.update({"act." + k: v for k, v in act.items()})
    cand = {}
    # backward, step 2, at the loss: log_softmax backward holds its saved output, the incoming grad and
    # the produced grad of the logits (all fp32 N x V); the int64 shift_labels is already freed
    comp["loss_backward_transient"] = 2 * N * V * 4 - N * 8
    cand["backward@loss (step 2)"] = W + S + A + comp["loss_backward_transient"]
    # optimizer step: params + grads + state + temporaries
    cand["optimizer.step"] = W + G + S + T
    # end of backward: all grads; a tied embedding/lm_head weight gets its second grad (embedding
    # backward, V x h dense) accumulated out of place: old grad + new grad + sum alive together
    # (under autocast only one extra V x h fp32: the lm_head grad arrives through the bf16->fp32 copy)
    mixed = precision in ("bf16-mixed", "fp16-mixed")
    comp["embedding_backward_transient"] = (1 if mixed else 2) * V * h * pb if tied else 0
    cand["backward end"] = W + S + G + comp["embedding_backward_transient"]
    # attention backward of the last layer (first layer processed in backward); with checkpointing this
    # layer's activations were just recomputed.  Approximation (see FINDINGS.md): the head's saved tensors
    # are gone, the lm_head grad (V x h) and the hidden-state grad (N x h) exist, the MLP half of the
    # layer is freed, and the attention backward holds its transients.
    head_saved = act["head.logsoftmax_fp32"] + act["head.final_norm"] + act["head.labels_int64"]
    attn_part = activations_end_of_forward(cfg, batch, seq, precision, False, attn)["layers.attn"] // L
    Nh, bas2 = N * h, batch * a * seq * seq
    if attn == "eager" or p > 0:
        k = 8 if precision == "fp32" or (kind == "gpt2" and precision == "bf16") else 6
        if p > 0 and precision == "fp32":
            k = 16  # fitted: softmax + dropout mask + dropped probs and their grads (2 cases measured)
        T_attn = k * bas2 + 3 * Nh * e
    else:
        T_attn = 3 * Nh * e + 3 * Nh * e  # grad q/k/v (+ grads before repeat_kv folding) for flash-cpu backward
    comp["attention_backward_transient"] = T_attn
    if checkpointing:
        live = A - head_saved + attn_part
    else:
        live = A - head_saved - sum(v for k_, v in act.items() if k_ == "layers.mlp") // L
    cand["backward@last-layer attention"] = W + S + live + V * h * pb + Nh * r + T_attn
    where = max(cand, key=cand.get)
    return {"peak": cand[where], "where": where, "candidates": cand, "components": comp}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(predict_peak(dict(kind="llama", h=128, L=2, a=8, kv=2, i=344, V=4000), 4, 128), indent=1))


