"""Reference computations with HF transformers for yatt-engine's parity tests and benchmarks.

Usage: python hf_ref.py COMMAND ARGS_JSON_FILE
  logits    {"model": dir, "prompts": [[ids...], ...], "out": file.safetensors}
  tokenize  {"model": dir, "texts": [...], "chats": [[{role, content}, ...], ...], "out": file.json}
  generate  {"model": dir, "threads": 2, "batches": [16, 64], "new_tokens": 64, "prompts": [[ids]], ...}
  train     {"model": dir, "threads": 2, "batch": B, "seq": T, "steps": N}
  load      {"model": dir, "prompt": [ids]}  (loads a checkpoint, prints logits checksum)
Prints one JSON object on stdout.
"""
import json
import sys
import time

import torch


def load_model(d, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    m.eval()
    return m


def cmd_logits(a):
    from safetensors.torch import save_file
    m = load_model(a["model"])
    out = {}
    with torch.no_grad():
        for i, p in enumerate(a["prompts"]):
            ids = torch.tensor([p], dtype=torch.long)
            out[f"logits_{i}"] = m(ids).logits[0].contiguous()
    save_file(out, a["out"])
    return {"n": len(out)}


def cmd_tokenize(a):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a["model"])
    texts = [tok(t)["input_ids"] for t in a.get("texts", [])]
    chats = []
    for c in a.get("chats", []):
        s = tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        chats.append({"text": s, "ids": tok(s, add_special_tokens=False)["input_ids"]})
    decoded = [tok.decode(ids) for ids in texts]
    return {"texts": texts, "chats": chats, "decoded": decoded}


def cmd_generate(a):
    torch.set_num_threads(a.get("threads", 2))
    m = load_model(a["model"])
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a["model"])
    tok.padding_side = "left"
    prompts = a["prompts"]
    res = {}
    for bs in a["batches"]:
        sel = [prompts[i % len(prompts)] for i in range(bs)]
        L = max(len(p) for p in sel)
        ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in sel])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in sel])
        torch.manual_seed(0)
        kw = dict(max_new_tokens=a["new_tokens"], min_new_tokens=a["new_tokens"], do_sample=True,
                  temperature=a.get("temperature", 1.0), top_k=a.get("top_k", 50), top_p=a.get("top_p", 1.0),
                  pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            m.generate(ids[:2], attention_mask=mask[:2], **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
            t = time.perf_counter()
            out = m.generate(ids, attention_mask=mask, **kw)
            dt = time.perf_counter() - t
        new = out[:, L:]
        n = int((new != tok.pad_token_id).sum()) if False else int(new.numel())
        res[str(bs)] = {"seconds": dt, "tokens": n, "tokens_per_s": n / dt}
    return res


def cmd_train(a):
    torch.set_num_threads(a.get("threads", 2))
    torch.manual_seed(0)
    m = load_model(a["model"])
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.0)
    B, T = a["batch"], a["seq"]
    ids = torch.randint(0, m.config.vocab_size, (B, T))
    times = []
    for step in range(a["steps"] + 1):
        t = time.perf_counter()
        logits = m(ids).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -lp.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0:
            times.append(time.perf_counter() - t)
    s = sum(times) / len(times)
    return {"seconds_per_step": s, "tokens_per_s": B * T / s}


def cmd_load(a):
    m = load_model(a["model"])
    with torch.no_grad():
        lg = m(torch.tensor([a["prompt"]])).logits[0, -1]
    return {"last_logits_head": lg[:8].tolist(), "argmax": int(lg.argmax())}


if __name__ == "__main__":
    cmd, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        args = json.load(f)
    r = globals()["cmd_" + cmd](args)
    print(json.dumps(r))
