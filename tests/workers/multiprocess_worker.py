"""One process of the two-process test: 2 CPU devices each, 4 global, a sharded forward and
`k3jax.generate` (greedy, sampled, the Engine, logprobs / penalties / stop ids / streaming,
speculative decoding; written per process).

    python tests/workers/multiprocess_worker.py PROCESS_ID PORT OUT_FILE
"""

import json
import os
import secrets
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
process_id, port, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import k3jax  # noqa: E402
from k3jax.engine import Engine, EngineConfig  # noqa: E402
from k3jax.sharding import MeshSpec, make_mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiprocess_cases import FEATURES, SPECULATIVE, streamed_tokens  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4, (jax.process_count(), jax.devices())
mesh = make_mesh(MeshSpec(data=2, expert=2))
model = k3jax.CausalLM.random(k3jax.tiny_kimi_linear(), seed=13, mesh=mesh)
ids = np.random.default_rng(0).integers(3, 512, (4, 10))
logits = multihost_utils.process_allgather(model.logits(ids), tiled=True)
if process_id == 0:
    np.save(out_file, np.asarray(logits))
# prefill then a decode step, the state's rows on both processes
last, state = model.prefill(ids[:, :9])
step, state = model.decode_step(state, ids[:, 9])
stepped = multihost_utils.process_allgather(step, tiled=True)
if process_id == 0:
    np.save(f"{out_file}.step.npy", np.asarray(stepped))
# generate in lockstep: greedy, and sampled with seeds each process draws itself (here 1000 + k on
# process 0, 2000 + k on process 1: the first process's are used)
fresh = iter(range(1000 * (process_id + 1), 1000 * (process_id + 2)))
secrets.randbits = lambda bits: next(fresh)
greedy = k3jax.generate(model, ids[:, :6].tolist(), k3jax.SamplingParams(max_tokens=5))
sampled = k3jax.generate(model, ids[:2, :6].tolist(), k3jax.SamplingParams(max_tokens=5, temperature=1.0, n=2))
engine = Engine(model, EngineConfig(max_slots=4, max_len=64, chunk_steps=4))
for r in range(4):    # slots 0-3: rows on both processes' devices (data=2)
    engine.add(f"greedy{r}" if r % 2 == 0 else f"sampled{r}", ids[r, :6].tolist(),
               k3jax.SamplingParams(max_tokens=6, temperature=float(r % 2)))
finished = {}
while engine.has_work():
    finished.update({u.request_id: u.result.token_ids for u in engine.step() if u.result is not None})
# logprobs, a penalty, a stop id and streaming; then speculative decoding (prompt lookup)
chunks = []
features = k3jax.generate(model, ids[:, :6].tolist(), FEATURES, stream=lambda c: chunks.append(c), stream_every=2)
speculative = k3jax.generate(model, ids[:, :6].tolist(), k3jax.SamplingParams(max_tokens=8), speculative=SPECULATIVE)
with open(f"{out_file}.generate_{process_id}.json", "w") as f:
    json.dump({"greedy": [r.token_ids for r in greedy],
               "sampled": [[c.token_ids for c in r.outputs] for r in sampled], "engine": finished,
               "features": [{"tokens": r.token_ids, "finish": r.outputs[0].finish_reason,
                             "logprobs": [{str(t): v for t, v in step.items()} for step in r.outputs[0].logprobs]}
                            for r in features],
               "streamed": streamed_tokens(chunks), "speculative": [r.token_ids for r in speculative]}, f)
multihost_utils.sync_global_devices("done")
jax.distributed.shutdown()
