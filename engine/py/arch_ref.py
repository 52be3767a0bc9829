"""Tiny random models of each architecture yatt runs, made by transformers itself, and
their reference outputs, for engine/tests/architectures.rs. Nothing is downloaded.

Usage: python arch_ref.py COMMAND ARGS_JSON_FILE
  make    {"model_type": "qwen3", "config": {...}, "seed": 0, "dir": out_dir,
           "prompts": [[ids...], ...], "new_tokens": 24, "out": file.safetensors}
          builds AutoModelForCausalLM.from_config, re-initialises it so that biases and
          norm weights matter, save_pretrained()s it into `dir` and writes
            logits_{i}   [T_i, V]  each prompt alone
            batch_logits [B, L, V] the prompts as one left-padded batch (mask given)
            greedy       [B, new]  greedy continuation of each prompt
  logits  {"dir": model_dir, "prompts": [[ids...]], "out": file.safetensors}
          loads a checkpoint (e.g. one yatt wrote) and writes logits_{i}
  peft    {"base": model_dir, "adapter": adapter_dir, "prompts": [[ids...]],
           "out": file.safetensors, "make": {"dir": d, "r": 4, "alpha": 8, "seed": 1,
           "targets": [...]} (optional)}
          loads the base with the adapter yatt wrote through `peft` and writes logits_{i};
          with "make", also makes an adapter of its own (random A and B), saves it with
          save_pretrained into make.dir and writes its logits as made_logits_{i}
Prints one JSON object on stdout.
"""
import json
import sys

import torch


def reinit(m, seed):
    # Large enough that attention is far from uniform and the biases and norms change
    # the logits; small enough that f32 logits stay O(1) (a 1e-4 tolerance then means
    # something).
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def logits_of(m, prompts):
    out = {}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            out[f"logits_{i}"] = m(torch.tensor([p])).logits[0].contiguous()
    return out


def cmd_make(a):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    torch.manual_seed(a["seed"])
    cfg = CONFIG_MAPPING[a["model_type"]](**a["config"])
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    reinit(m, a["seed"])
    m.eval()
    m.save_pretrained(a["dir"])
    prompts = a["prompts"]
    out = logits_of(m, prompts)
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out["batch_logits"] = m(ids, attention_mask=mask).logits.contiguous()
        greedy = []
        n = a["new_tokens"]
        for p in prompts:
            g = m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                           eos_token_id=None)
            greedy.append(g[0, len(p):])
        out["greedy"] = torch.stack(greedy).contiguous()
    save_file(out, a["out"])
    return {"model_type": a["model_type"], "parameters": sum(p.numel() for p in m.parameters())}


def cmd_logits(a):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(a["dir"], dtype=torch.float32, attn_implementation="eager")
    m.eval()
    save_file(logits_of(m, a["prompts"]), a["out"])
    return {"model_type": m.config.model_type}


def cmd_peft(a):
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    def base():
        m = AutoModelForCausalLM.from_pretrained(a["base"], dtype=torch.float32, attn_implementation="eager")
        return m.eval()

    m = PeftModel.from_pretrained(base(), a["adapter"]).eval()
    out = logits_of(m, a["prompts"])
    mk = a.get("make")
    if mk:
        torch.manual_seed(mk["seed"])
        cfg = LoraConfig(r=mk["r"], lora_alpha=mk["alpha"], target_modules=mk["targets"],
                         lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")
        made = get_peft_model(base(), cfg).eval()
        made.save_pretrained(mk["dir"])
        for k, v in logits_of(made, a["prompts"]).items():
            out["made_" + k] = v
    save_file(out, a["out"])
    return {"peft": __import__("peft").__version__}


if __name__ == "__main__":
    cmd, argf = sys.argv[1], sys.argv[2]
    with open(argf) as f:
        args = json.load(f)
    print(json.dumps({"make": cmd_make, "logits": cmd_logits, "peft": cmd_peft}[cmd](args)))
