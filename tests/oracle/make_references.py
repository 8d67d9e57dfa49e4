"""Builds outside-reference data for the JAX tests. Runs in the Python 3.11 oracle venv (torch CPU).

    .venv-oracle/bin/python tests/oracle/make_references.py OUT_DIR

Writes:
  OUT_DIR/hf/<name>/        tiny transformers KimiLinearForCausalLM checkpoints (save_pretrained)
                            plus reference.npz: full-forward logits (fp32, and the same weights
                            run in bf16), cached step-by-step decode logits and 16 greedy tokens
                            from HF `generate` with their logits.
  OUT_DIR/fla/kda_cases.npz fla naive_recurrent_kda / naive_chunk_kda inputs and outputs.
  OUT_DIR/chat/cases.json   transformers' rendering of the built-in Kimi-Linear chat template
                            (k3jax/templates/kimi_linear_chat.jinja) for chats with tools and tool calls.
Never import triton here: with it, transformers switches kimi_linear to GPU-only kernels.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import torch

# name -> (config overrides, prompt length, decode steps after a prefill)
HF_MODELS = {
    # KDA / MLA alternating, one dense layer then three MoE layers.
    "kl_alt": (dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
               20, 6),
    # MLA first and in the middle, two dense layers, grouped routing, 2 shared experts, no renormalisation,
    # other head counts and widths.
    "kl_mla_first": (dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                       "linear_attention"],
                          mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
                          num_hidden_layers=5, n_group=2, topk_group=1, n_shared_experts=2, norm_topk_prob=False,
                          routed_scaling_factor=1.0, linear_num_heads=2, linear_head_dim=32, num_attention_heads=2,
                          num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16,
                          v_head_dim=24), 18, 5),
    # The released Kimi-Linear pattern (MLA at 1-based layers 4 and 6), prompts longer than one
    # 64-token KDA chunk.
    "kl_release": (dict(layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention",
                                                                 "full_attention"],
                        num_hidden_layers=6), 80, 4),
}
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
GREEDY_TOKENS = 16


def _rerandomise(model, gen: torch.Generator) -> None:
    """Weights with O(1) signals everywhere, and every default-valued tensor made to matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue  # transformers already draws these at random (fla's initialisation)
            if p.ndim == 1 or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build_hf(out_dir: str) -> None:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    for seed, (name, (overrides, prompt_len, steps)) in enumerate(HF_MODELS.items()):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        cfg = KimiLinearConfig(**{**BASE, **overrides})
        model = KimiLinearForCausalLM(cfg).eval()
        _rerandomise(model, gen)
        path = os.path.join(out_dir, name)
        model.save_pretrained(path)

        ids = torch.randint(3, cfg.vocab_size, (2, prompt_len + steps), generator=gen)
        with torch.no_grad():
            full = model(ids, use_cache=False).logits.float().numpy()
            out = model(ids[:, :prompt_len], use_cache=True)
            cache = out.past_key_values
            step_logits = [out.logits[:, -1].float().numpy()]
            for t in range(prompt_len, prompt_len + steps):
                out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                step_logits.append(out.logits[:, -1].float().numpy())
            gen_out = model.generate(ids[:, :prompt_len], attention_mask=torch.ones_like(ids[:, :prompt_len]),
                                     max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            full_bf16 = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(
                ids, use_cache=False).logits.float().numpy()
        np.savez(os.path.join(path, "reference.npz"),
                 input_ids=ids.numpy(), prompt_len=prompt_len, full_logits=full, full_logits_bf16=full_bf16,
                 step_logits=np.stack(step_logits, axis=1),
                 greedy_tokens=gen_out.sequences[:, prompt_len:].numpy(),
                 greedy_logits=torch.stack(gen_out.logits, dim=1).float().numpy())


# name -> (B, T, H, K, V, gate range (low, high) for g in log space, initial state?, fla chunk usable?)
KDA_CASES = {
    "moderate": (2, 128, 2, 32, 32, (-1.0, 0.0), True, True),
    "uneven_dims": (1, 64, 3, 16, 24, (-0.5, -0.01), False, True),
    "gates_at_floor": (1, 192, 2, 16, 16, (-20.0, -5.0), True, False),  # fla's naive chunk overflows here
}


def build_fla(out_dir: str) -> None:
    import fla

    spec = importlib.util.spec_from_file_location(
        "fla_kda_naive", os.path.join(os.path.dirname(fla.__file__), "ops", "kda", "naive.py"))
    naive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive)
    gen = torch.Generator().manual_seed(7)
    arrays, meta = {}, {}
    for name, (b, t, h, k, v, (lo, hi), init, chunk_ok) in KDA_CASES.items():
        q = torch.nn.functional.normalize(torch.randn(b, t, h, k, generator=gen), dim=-1)
        kk = torch.nn.functional.normalize(torch.randn(b, t, h, k, generator=gen), dim=-1)
        vv = torch.randn(b, t, h, v, generator=gen)
        g = lo + (hi - lo) * torch.rand(b, t, h, k, generator=gen)
        beta = torch.rand(b, t, h, generator=gen)
        s0 = torch.randn(b, h, k, v, generator=gen) if init else None
        o, s = naive.naive_recurrent_kda(q, kk, vv, g, beta, initial_state=s0, output_final_state=True)
        arrays.update({f"{name}/q": q, f"{name}/k": kk, f"{name}/v": vv, f"{name}/g": g, f"{name}/beta": beta,
                       f"{name}/o_recurrent": o, f"{name}/s_recurrent": s})
        if s0 is not None:
            arrays[f"{name}/s0"] = s0
        if chunk_ok:
            oc, sc = naive.naive_chunk_kda(q, kk, vv, g, beta, initial_state=s0, output_final_state=True)
            arrays.update({f"{name}/o_chunk": oc, f"{name}/s_chunk": sc})
        meta[name] = {"initial_state": init, "fla_chunk": chunk_ok}
    np.savez(os.path.join(out_dir, "kda_cases.npz"), **{k: a.numpy() for k, a in arrays.items()})
    with open(os.path.join(out_dir, "kda_cases.json"), "w") as f:
        json.dump(meta, f)


TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "k3jax", "templates", "kimi_linear_chat.jinja")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two integers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}},
                                               "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "météo", "description": "Wetter für eine Stadt",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CHATS = {
    "plain": ([{"role": "user", "content": "Hello! 你好"}], None, True),
    "system_and_turns": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}], None, True),
    "no_generation_prompt": ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], None, False),
    "content_parts": ([{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                    {"type": "text", "text": "part two"}]}], None, True),
    "tools_and_calls": ([{"role": "user", "content": "What is 2 + 2, and the weather in Zürich?"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"id": "functions.add:0", "type": "function",
                                          "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}},
                                         {"id": "functions.météo:1", "type": "function",
                                          "function": {"name": "météo", "arguments": {"city": "Zürich"}}}]},
                         {"role": "tool", "tool_call_id": "functions.add:0", "content": "4"},
                         {"role": "tool", "tool_call_id": "functions.météo:1", "content": "sunny, 21°C"}],
                        TOOLS, True),
}


def build_chat(out_dir: str) -> None:
    """transformers' own Jinja rendering of the chat template for every chat above."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with open(TEMPLATE) as f:
        template = f.read()
    cases = {}
    for name, (messages, tools, add_generation_prompt) in CHATS.items():
        out = render_jinja_template([messages], tools=tools, chat_template=template,
                                    add_generation_prompt=add_generation_prompt, bos_token="[BOS]",
                                    eos_token="<|im_end|>")
        rendered = out[0] if isinstance(out, tuple) else out
        cases[name] = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                       "rendered": rendered[0] if isinstance(rendered, list) else rendered}
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump({"template": template, "cases": cases}, f, ensure_ascii=False, indent=1)


def main() -> None:
    out = sys.argv[1]
    for part in ("hf", "fla", "chat"):
        os.makedirs(os.path.join(out, part), exist_ok=True)
    torch.set_num_threads(2)
    build_chat(os.path.join(out, "chat"))
    build_fla(os.path.join(out, "fla"))
    build_hf(os.path.join(out, "hf"))


if __name__ == "__main__":
    main()
