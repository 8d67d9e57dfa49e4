"""A bf16 KDA recurrent state (`kda_state="bfloat16"`): stored in bf16 everywhere the state lives,
close to the fp32 state over a short run, and speculative decoding still equals plain greedy
decoding with the same state dtype (the verify/commit kernels round after every token)."""

from __future__ import annotations

import jax.numpy as jnp
from tolerances import assert_close

import k3jax
from k3jax.config import tiny_k3, tiny_kimi_linear
from k3jax.memory_plan import state_bytes
from k3jax.sharding import MeshSpec
from k3jax.speculative import SpeculativeConfig
from k3jax.synthetic import plant_greedy_chain


def test_bf16_state_decodes_close_to_fp32(rng):
    model32 = k3jax.CausalLM.random(tiny_kimi_linear(), seed=3)
    model16 = model32.with_impls(kda_state="bfloat16")
    ids = rng.integers(0, model32.config.vocab_size, (2, 9))
    lg32, st32 = model32.prefill(ids, max_len=32)
    lg16, st16 = model16.prefill(ids, max_len=32)
    kda_layers = [layer for layer in st16.layers if hasattr(layer, "recurrent")]
    assert kda_layers and all(layer.recurrent.dtype == jnp.bfloat16 for layer in kda_layers)
    assert_close("prefill", lg16, lg32, dtype="bfloat16")
    nxt = jnp.argmax(lg32, axis=-1)
    for _ in range(8):
        out32, st32 = model32.decode_step(st32, nxt)
        out16, st16 = model16.decode_step(st16, nxt)
        nxt = jnp.argmax(out32, axis=-1)
    assert all(layer.recurrent.dtype == jnp.bfloat16 for layer in st16.layers if hasattr(layer, "recurrent"))
    assert_close("after 8 decode steps", out16, out32, dtype="bfloat16")


def test_bf16_state_halves_its_bytes():
    cfg = tiny_kimi_linear()
    kda32, _ = state_bytes(cfg, MeshSpec(), 4, 64, "float32")
    kda16, _ = state_bytes(cfg.with_impls(kda_state="bfloat16"), MeshSpec(), 4, 64, "float32")
    conv = 4 * (cfg.kda.conv_size - 1) * 3 * cfg.kda.proj_size * 4 * cfg.mixers.count("kda")
    assert kda16 - conv == (kda32 - conv) // 2


def test_speculative_greedy_equals_plain_greedy_with_a_bf16_state():
    """Prompt lookup on a planted greedy chain (drafts accepted, so the commit replays kept tokens
    through the window kernel) gives the tokens of plain greedy decoding, both with a bf16 state."""
    cfg = tiny_k3(num_layers=4, attn_res_block_size=2)     # KDA and MLA layers, MTP
    base = k3jax.CausalLM.random(cfg, seed=0).with_impls(kda_state="bfloat16", kda_decode="pallas")
    planted, perm = plant_greedy_chain(base, seed=5)
    chain = [17]
    for _ in range(11):
        chain.append(int(perm[chain[-1]]))
    gen = k3jax.Generator(planted)
    params = k3jax.SamplingParams(max_tokens=10, ignore_eos=True)
    plain = gen.generate([chain[:10] + chain[:2]], params)
    out = gen.generate([chain[:10] + chain[:2]], params, speculative=SpeculativeConfig("ngram", 3))
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert out.timings.speculative.accepted >= 6
