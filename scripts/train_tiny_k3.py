"""Trains `tiny-k3`: a tiny Kimi K3 (every K3 feature on) on the Python standard library's own
source, with the project's tokenizer (Kimi layout, BPE trained here on the same text), and writes it as a
Hugging Face checkpoint in the released K3 layout plus its tokenizer, checksums and a training record.

    PYTHONPATH=. python scripts/train_tiny_k3.py --out k3jax/models/tiny_k3

Everything is fixed by --seed: the file selection (every *.py of the stdlib outside test suites and
data packages, sorted by path, HELDOUT modules kept out), the BPE, the initial weights, the training windows. JAX + optax, our own model code, the
pure-JAX chunked KDA path for gradients (no Pallas). Loss: next-token cross-entropy of the main model plus
MTP_WEIGHT times the next-next-token cross-entropy of the MTP layer (arch §7 alignment: the MTP layer at
position p reads the target's pre-norm hidden state at p and the embedding of token p + 1).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import sysconfig
import time

import numpy as np
import regex

HELDOUT = ("bisect.py", "colorsys.py", "fractions.py", "heapq.py", "textwrap.py")
MTP_WEIGHT = 0.3
EVAL_SLICE = "eval_slice.txt"
FIB_PROMPT = "def fibonacci(n):"
# The demo's sampling (`make demo`): greedy with a repetition penalty (plain greedy decoding of a model
# this small falls into a loop of one line).
DEMO_SAMPLING = {"max_new_tokens": 64, "temperature": 0.0, "repetition_penalty": 1.3}


# ----- data -----
SKIP_DIRS = {"__pycache__", "site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}


def select_files(stdlib: str) -> tuple[list[str], list[str]]:
    """Every *.py file under the stdlib directory, by relative path in sorted order, skipping test
    suites, installed packages and data-only packages (SKIP_DIRS): (training files, held-out files)."""
    names = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        rel = os.path.relpath(root, stdlib)
        names += [os.path.normpath(os.path.join(rel, f)) for f in files
                  if f.endswith(".py") and os.path.isfile(os.path.join(root, f))]
    names.sort()
    return [n for n in names if n not in HELDOUT], [n for n in names if n in HELDOUT]


def read(stdlib: str, names: list[str]) -> list[str]:
    out = []
    for n in names:
        with open(os.path.join(stdlib, n), encoding="utf-8", errors="replace") as f:
            out.append(f.read())
    return out


# ----- fast byte-level BPE -----
def bpe_train(texts: list[str], num_ranks: int, pattern: str) -> dict[bytes, int]:
    """Byte-level BPE over pre-token counts: each distinct regex-split word is counted once, pair counts
    and a pair -> words index are updated incrementally per merge. Ties break on the pair's bytes, so the
    result is deterministic. Ranks are merge order (what tiktoken expects)."""
    counts = collections.Counter()
    pat = regex.compile(pattern, regex.V1)  # V1: the class intersections (&&) of the Kimi pattern
    for t in texts:
        counts.update(pat.findall(t))
    vocab = [bytes([i]) for i in range(256)]
    words = [list(w.encode("utf-8")) for w in counts]
    freq = list(counts.values())
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += freq[wi]
            where[(a, b)].add(wi)
    while len(vocab) < num_ranks and pairs:
        best = max(pairs.items(), key=lambda kv: (kv[1], vocab[kv[0][0]] + vocab[kv[0][1]]))[0]
        new = len(vocab)
        vocab.append(vocab[best[0]] + vocab[best[1]])
        for wi in list(where[best]):
            w, f = words[wi], freq[wi]
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] -= f
                if pairs[(a, b)] <= 0:
                    del pairs[(a, b)]
            merged, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(w[i])
                    i += 1
            words[wi] = merged
            for a, b in zip(merged, merged[1:]):
                pairs[(a, b)] += f
                where[(a, b)].add(wi)
        where.pop(best, None)
    return {tok: i for i, tok in enumerate(vocab)}


# ----- model -----
def model_config(vocab_size: int, bos: int, eos: int, pad: int):
    from k3jax.config import (Activation, AttnResConfig, KDAConfig, MLAConfig, MLPConfig, ModelConfig,
                              MoEConfig)
    hidden, layers = 128, 4
    act = Activation("situ", 4.0, 25.0)
    mixers = tuple("mla" if (i % 4 == 3 or i == layers - 1) else "kda" for i in range(layers))
    ffns = tuple("dense" if i == 0 else "moe" for i in range(layers))
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden, mixers=mixers, ffns=ffns,
        kda=KDAConfig(hidden_size=hidden, num_heads=4, head_dim=32, chunk_size=16, gate_lower_bound=-5.0,
                      use_full_rank_gate=True, impl="chunked"),
        mla=MLAConfig(hidden_size=hidden, num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                      v_head_dim=32, q_lora_rank=64, use_output_gate=True, prefill_impl="naive"),
        mlp=MLPConfig(hidden_size=hidden, intermediate_size=384, activation=act),
        moe=MoEConfig(hidden_size=hidden, num_experts=8, num_experts_per_token=2, expert_intermediate_size=96,
                      num_shared_experts=1, activation=act, latent_size=64, latent_use_norm=True, impl="dense"),
        attn_res=AttnResConfig(block_size=2),
        mtp_mixers=("mla",), mtp_ffns=("moe",),
        max_position_embeddings=4096,
        bos_token_id=bos, eos_token_id=(eos,), pad_token_id=pad, model_type="kimi_k3",
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", default=None,
                   help="directory of the stdlib's *.py files (default: this interpreter's own stdlib)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--base-vocab", type=int, default=1024)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--finalize-only", action="store_true", help="only re-run the finalize step on --out")
    p.add_argument("--time-steps", type=int, default=0, help="only time this many steps, write nothing")
    args = p.parse_args(argv)
    if args.finalize_only:
        finalize(args.out)
        return 0
    t_start = time.time()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from k3jax.causal_lm import CausalLM
    from k3jax.model import KimiForCausalLM
    from k3jax.state import SeqInfo
    from k3jax.tiny import K3_SPECIALS
    from k3jax.tokenizer import KIMI_PATTERN, KimiTokenizer

    stdlib = args.stdlib or sysconfig.get_paths()["stdlib"]
    train_names, held_names = select_files(stdlib)
    train_texts, held_texts = read(stdlib, train_names), read(stdlib, held_names)
    corpus_sha = hashlib.sha256("\0".join(train_texts + held_texts).encode()).hexdigest()
    print(f"stdlib {stdlib}: {len(train_names)} training files ({sum(map(len, train_texts))} chars), "
          f"held out {held_names}", flush=True)

    t0 = time.time()
    ranks = bpe_train(train_texts, args.base_vocab, KIMI_PATTERN)
    specials = {len(ranks) + off: name for off, name in K3_SPECIALS.items()}
    tok = KimiTokenizer(ranks, specials, bos_token="[BOS]", eos_token="<|end_of_msg|>", name="tiny-k3")
    print(f"BPE {len(ranks)} ranks in {time.time() - t0:.1f}s; vocab {tok.vocab_size}", flush=True)

    def stream(texts):
        ids = []
        for t in texts:
            ids.append(tok.bos_token_id)
            ids.extend(tok.encode(t))
        return np.asarray(ids, np.int32)

    train_ids, held_ids = stream(train_texts), stream(held_texts)
    print(f"tokens: train {train_ids.size}, held-out {held_ids.size} "
          f"({sum(map(len, train_texts)) / train_ids.size:.2f} chars/token)", flush=True)

    cfg = model_config(tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.special_id("[PAD]"))
    module = KimiForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(module)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"parameters: {n_params} ({n_params * 4 / 2**20:.2f} MiB fp32)", flush=True)

    def losses(params, x_BT, y_BT, y2_BT):
        model = nnx.merge(graphdef, params)
        valid = jnp.ones(x_BT.shape, bool)
        hidden, _ = model(x_BT, SeqInfo.make(valid), None, fresh=True)
        main = optax.softmax_cross_entropy_with_integer_labels(model.logits(hidden), y_BT).mean()
        t = x_BT.shape[1]
        pos = jnp.broadcast_to(jnp.arange(t - 1), (x_BT.shape[0], t - 1))
        h, _ = model.mtp[0].draft(hidden[:, :-1], x_BT[:, 1:], pos, model.mtp_embedding(),
                                  SeqInfo.make(valid[:, :-1]), None, fresh=True)
        mtp = optax.softmax_cross_entropy_with_integer_labels(model.mtp[0].shared_head(h), y2_BT[:, :-1]).mean()
        return main, mtp

    def total(params, *batch):
        main, mtp = losses(params, *batch)
        return main + MTP_WEIGHT * mtp, (main, mtp)

    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                               end_value=args.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, x, y, y2):
        (_, (main, mtp)), grads = jax.value_and_grad(total, has_aux=True)(params, x, y, y2)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, main, mtp

    eval_losses = jax.jit(losses)
    rng = np.random.default_rng(args.seed)

    def batch_at(ids, starts):
        w = np.stack([ids[s:s + args.seq + 2] for s in starts])
        return w[:, :-2], w[:, 1:-1], w[:, 2:]

    def evaluate(params, ids, max_windows=64):
        n = min((ids.size - 2) // args.seq, max_windows)
        starts = np.arange(n) * args.seq
        out = [], []
        for i in range(0, n, args.batch):
            m, t = eval_losses(params, *batch_at(ids, starts[i:i + args.batch]))
            out[0].append(float(m) * len(starts[i:i + args.batch]))
            out[1].append(float(t) * len(starts[i:i + args.batch]))
        return sum(out[0]) / n, sum(out[1]) / n

    history = []
    t_train = time.time()
    n_steps = args.time_steps or args.steps
    for s in range(1, n_steps + 1):
        starts = rng.integers(0, train_ids.size - args.seq - 2, args.batch)
        params, opt_state, main, mtp = step(params, opt_state, *batch_at(train_ids, starts))
        if s == 1:
            main.block_until_ready()
            t_compiled = time.time()
            print(f"compile + step 1: {t_compiled - t_train:.1f}s", flush=True)
        if s % 25 == 0 or s == n_steps or (args.time_steps and s <= 5):
            main.block_until_ready()
            el = time.time() - t_compiled
            print(f"step {s}: loss {float(main):.4f} mtp {float(mtp):.4f} "
                  f"({(s - 1) / el:.2f} steps/s, {el:.0f}s)", flush=True)
        if args.time_steps:
            continue
        if s % args.eval_every == 0 or s == n_steps:
            he = evaluate(params, held_ids)
            history.append({"step": s, "train_batch_loss": float(main), "train_batch_mtp_loss": float(mtp),
                            "heldout_loss": he[0], "heldout_mtp_loss": he[1]})
            print(f"  eval step {s}: held-out loss {he[0]:.4f} mtp {he[1]:.4f}", flush=True)
            os.makedirs(args.out + ".partial", exist_ok=True)
            np.savez(os.path.join(args.out + ".partial", "params.npz"),
                     **{"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)})
    if args.time_steps:
        return 0
    train_time = time.time() - t_train

    train_eval = evaluate(params, train_ids[:held_ids.size * 4], max_windows=64)
    held_eval = evaluate(params, held_ids, max_windows=10**6)
    print(f"final: train loss {train_eval[0]:.4f} (mtp {train_eval[1]:.4f}), "
          f"held-out loss {held_eval[0]:.4f} (mtp {held_eval[1]:.4f})", flush=True)

    # ----- export: HF layout (checkpoint writer), tokenizer, eval slice, record, checksums -----
    from k3jax.checkpoint.writer import save_checkpoint
    model = CausalLM(nnx.merge(graphdef, params), tokenizer=tok)
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):
        os.remove(os.path.join(args.out, f))
    save_checkpoint(model, args.out)
    tok.save_pretrained(args.out)
    eval_text = held_texts[held_names.index("textwrap.py")][:6000]
    with open(os.path.join(args.out, EVAL_SLICE), "w", encoding="utf-8") as f:
        f.write(eval_text)
    import subprocess
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "model": "tiny-k3",
        "command": "PYTHONPATH=. python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:] if argv is None
                                                     else [os.path.relpath(__file__)] + list(argv)),
        "git_commit": rev, "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "lr": args.lr, "warmup": args.warmup, "schedule": "linear warmup, cosine to 0.1 * lr; adamw b2=0.95 wd=0.01, "
        "clip 1.0", "mtp_loss_weight": MTP_WEIGHT,
        "python": sys.version.split()[0], "jax": jax.__version__, "optax": optax.__version__,
        "device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
        "data": {"source": "the stdlib's *.py files by relative path, sorted, without the directories "
                           + ", ".join(sorted(SKIP_DIRS)), "stdlib": stdlib,
                 "train_files": train_names, "heldout_files": held_names, "corpus_sha256": corpus_sha,
                 "train_tokens": int(train_ids.size), "heldout_tokens": int(held_ids.size),
                 "separator": "[BOS] before each file"},
        "tokenizer": {"base_ranks": len(ranks), "vocab_size": tok.vocab_size,
                      "trainer": "scripts/train_tiny_k3.py bpe_train (byte-level, Kimi split pattern)"},
        "parameters": int(n_params),
        "train_seconds": round(train_time, 1), "total_seconds": round(time.time() - t_start, 1),
        "final": {"train_loss": train_eval[0], "train_mtp_loss": train_eval[1], "heldout_loss": held_eval[0],
                  "heldout_mtp_loss": held_eval[1],
                  "note": "train: first 64 windows of the training stream; held-out: every full window of the "
                          "held-out files; fp32; next-token CE in nats/token"},
        "history": history,
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    finalize(args.out)
    return 0


def finalize(out: str) -> None:
    """Loads the written checkpoint by the ordinary loader (fp32), records the loss on the shipped
    held-out slice (what the CI test checks) and the demo's sample for `def fibonacci(n):` in
    training.json, then writes SHA256SUMS over every file of the directory."""
    import k3jax
    from k3jax.tiny import CHECKSUMS, eval_slice_loss
    model = k3jax.load(out, dtype="float32")
    loss, n = eval_slice_loss(model, out)
    sample = k3jax.generate(model, [FIB_PROMPT], k3jax.SamplingParams(**DEMO_SAMPLING))
    text = sample.results[0].outputs[0].text if hasattr(sample, "results") else str(sample)
    path = os.path.join(out, "training.json")
    with open(path) as f:
        record = json.load(f)
    record["eval_slice"] = {"file": EVAL_SLICE, "source": "first 6000 characters of the held-out textwrap.py",
                            "predicted_tokens": n, "loss": loss, "dtype": "float32"}
    record.pop("greedy_sample", None)
    record["demo_sample"] = {"prompt": FIB_PROMPT, **DEMO_SAMPLING, "text": text}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"eval slice: {n} tokens, loss {loss:.5f}\n{FIB_PROMPT}{text}", flush=True)
    names = sorted(f for f in os.listdir(out) if f != CHECKSUMS)
    with open(os.path.join(out, CHECKSUMS), "w") as f:
        for name in names:
            with open(os.path.join(out, name), "rb") as g:
                f.write(f"{hashlib.sha256(g.read()).hexdigest()}  {name}\n")


if __name__ == "__main__":
    sys.exit(main())
