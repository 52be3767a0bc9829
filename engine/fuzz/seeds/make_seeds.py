#!/usr/bin/env python3
"""Writes the engine fuzz targets' seed inputs (standard library only; run from any
directory): small valid files that reach past the parsers into the code that uses
them. `scripts/fuzz.sh` passes `seeds/TARGET` to libFuzzer as a read-only corpus."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def out(target, name, data):
    d = os.path.join(HERE, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- GGUF --------------------------------------------------------------------------


def f16(x):
    return struct.pack("<e", x)


class Gguf:
    """A GGUF v3 writer: metadata key/values, then tensors (name, ggml dims, type, bytes)."""

    def __init__(self):
        self.kvs = []

    @staticmethod
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    def kv(self, key, ty, payload):
        self.kvs.append(self.s(key) + struct.pack("<I", ty) + payload)

    def str(self, k, v):
        self.kv(k, 8, self.s(v))

    def u32(self, k, v):
        self.kv(k, 4, struct.pack("<I", v))

    def f32(self, k, v):
        self.kv(k, 6, struct.pack("<f", v))

    def strs(self, k, v):
        self.kv(k, 9, struct.pack("<IQ", 8, len(v)) + b"".join(self.s(x) for x in v))

    def i32s(self, k, v):
        self.kv(k, 9, struct.pack("<IQ", 5, len(v)) + b"".join(struct.pack("<i", x) for x in v))

    def bytes(self, tensors):
        b = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(self.kvs)) + b"".join(self.kvs)
        off = 0
        for name, dims, ty, data in tensors:
            b += self.s(name) + struct.pack("<I", len(dims))
            b += b"".join(struct.pack("<Q", d) for d in dims)
            b += struct.pack("<IQ", ty, off)
            off += -(-len(data) // 32) * 32
        b += b"\0" * (-len(b) % 32)
        for _, _, _, data in tensors:
            b += data + b"\0" * (-len(data) % 32)
        return b


F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30


def f32s(n, x=0.5):
    return struct.pack(f"<{n}f", *([x] * n))


def q8_0(blocks):
    return (f16(0.5) + bytes(range(32))) * blocks


def q4_0(blocks):
    return (f16(0.25) + bytes(range(16))) * blocks


def q4_1(blocks):
    return (f16(0.25) + f16(-1.0) + bytes(range(16))) * blocks


def llama_gguf(arch="llama", rope_freqs=False, chat_template=False):
    """A 1-layer model of width 4 (2 heads of 2, 1 KV head), every supported type."""
    g = Gguf()
    g.str("general.architecture", arch)
    for k, v in [("embedding_length", 4), ("block_count", 1), ("feed_forward_length", 8),
                 ("attention.head_count", 2), ("attention.head_count_kv", 1),
                 ("context_length", 64)]:
        g.u32(f"{arch}.{k}", v)
    g.f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    g.f32(f"{arch}.rope.freq_base", 10000.0)
    g.str("tokenizer.ggml.model", "gpt2")
    g.str("tokenizer.ggml.pre", {"llama": "smollm", "qwen2": "qwen2"}.get(arch, "llama-bpe"))
    g.strs("tokenizer.ggml.tokens", ["<|endoftext|>", "a", "b", "ab", "\u0120"])
    g.i32s("tokenizer.ggml.token_type", [3, 1, 1, 1, 1])
    g.strs("tokenizer.ggml.merges", ["a b"])
    g.u32("tokenizer.ggml.bos_token_id", 0)
    g.u32("tokenizer.ggml.eos_token_id", 0)
    if chat_template:
        g.str("tokenizer.chat_template",
              "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    t = [
        ("token_embd.weight", [4, 5], F32, f32s(20)),
        ("blk.0.attn_norm.weight", [4], F32, f32s(4, 1.0)),
        ("blk.0.attn_q.weight", [4, 4], F16, f16(0.5) * 16),
        ("blk.0.attn_k.weight", [4, 2], BF16, struct.pack("<H", 0x3F00) * 8),
        ("blk.0.attn_v.weight", [4, 2], F32, f32s(8)),
        ("blk.0.attn_output.weight", [4, 4], F32, f32s(16)),
        ("blk.0.ffn_norm.weight", [4], F32, f32s(4, 1.0)),
        ("blk.0.ffn_gate.weight", [4, 8], Q8_0, q8_0(1)),
        ("blk.0.ffn_up.weight", [4, 8], Q4_0, q4_0(1)),
        ("blk.0.ffn_down.weight", [8, 4], Q4_1, q4_1(1)),
        ("output_norm.weight", [4], F32, f32s(4, 1.0)),
    ]
    if arch == "qwen2":
        t += [("blk.0.attn_q.bias", [4], F32, f32s(4)), ("blk.0.attn_k.bias", [2], F32, f32s(2)),
              ("blk.0.attn_v.bias", [2], F32, f32s(2))]
    if arch == "qwen3":
        t += [("blk.0.attn_q_norm.weight", [2], F32, f32s(2, 1.0)),
              ("blk.0.attn_k_norm.weight", [2], F32, f32s(2, 1.0))]
    if rope_freqs:
        t.append(("rope_freqs.weight", [1], F32, f32s(1, 1.0)))
    return g.bytes(t)


out("gguf", "llama.gguf", llama_gguf())
out("gguf", "llama-rope-freqs-template.gguf", llama_gguf(rope_freqs=True, chat_template=True))
out("gguf", "qwen2.gguf", llama_gguf("qwen2"))
out("gguf", "qwen3.gguf", llama_gguf("qwen3"))

# --- config.json -------------------------------------------------------------------

base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "eos_token_id": [1, 2], "bos_token_id": 0, "hidden_act": "silu"}
configs = {
    "llama.json": base,
    "llama3-rope.json": {**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}},
    "linear-rope-parameters.json": {**base, "rope_parameters": {"rope_type": "linear",
                                    "factor": 2.0, "rope_theta": 500000.0}},
    "mistral.json": {**base, "model_type": "mistral", "sliding_window": 16},
    "qwen2-window.json": {**base, "model_type": "qwen2", "sliding_window": 8,
                          "use_sliding_window": True, "max_window_layers": 1},
    "qwen3-layer-types.json": {**base, "model_type": "qwen3", "head_dim": 32,
                               "sliding_window": 8, "use_sliding_window": True,
                               "layer_types": ["full_attention", "sliding_attention"]},
}
for name, c in configs.items():
    out("model_config", name, json.dumps(c, indent=1))

# --- model.safetensors --------------------------------------------------------------


def safetensors(tensors, metadata=None):
    """tensors: (name, dtype, shape, bytes)."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def model(dtype="F32", extra=()):
    """The fuzz target's model: width 2, 1 layer, 1 head of 2, FFN 1, vocab 2, tied."""
    one = {"F32": struct.pack("<f", 1.0), "BF16": struct.pack("<H", 0x3F80),
           "F16": f16(1.0)}[dtype]
    def t(name, shape):
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        return (name, dtype, shape, one * numel)

    p = "model.layers.0."
    return [t("model.embed_tokens.weight", [2, 2]),
            t(p + "input_layernorm.weight", [2]), t(p + "post_attention_layernorm.weight", [2]),
            t(p + "self_attn.q_proj.weight", [2, 2]), t(p + "self_attn.k_proj.weight", [2, 2]),
            t(p + "self_attn.v_proj.weight", [2, 2]), t(p + "self_attn.o_proj.weight", [2, 2]),
            t(p + "mlp.gate_proj.weight", [1, 2]), t(p + "mlp.up_proj.weight", [1, 2]),
            t(p + "mlp.down_proj.weight", [2, 1]), t("model.norm.weight", [2])] + list(extra)


out("safetensors", "model-f32.safetensors", safetensors(model(), {"format": "pt"}))
out("safetensors", "model-bf16-score-head.safetensors", safetensors(
    model("BF16", [("score.weight", "BF16", [1, 2], struct.pack("<H", 0x3F80) * 2)])))
out("safetensors", "model-f16-extra.safetensors", safetensors(
    model("F16", [("lm_head.weight", "F16", [2, 2], f16(1.0) * 4),
                  ("model.layers.1.mlp.up_proj.weight", "I64", [1], struct.pack("<q", 7))])))
