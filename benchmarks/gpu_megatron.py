"""Megatron-LM's checkpoints on a GPU: alpsck's dist_checkpointing strategies against Megatron's own torch_dist, in
the same run (issue 56, item 1; docs/megatron.md). One rank (tensor parallel 1), a megatron-core GPT on the device.

For each repetition, alternating: ``dist_checkpointing.save`` of the model's sharded state with Megatron's default
``torch_dist`` strategy and with alpsck's (:func:`alpsck.integrations.megatron.save_strategy`), each into a new
``iter_N`` directory, then ``dist_checkpointing.load`` of each into a second model on the device, whose parameters
must then equal the first model's, bit for bit. Reports the median seconds of each save and load and alpsck/default.

``--device cpu`` runs the alpsck half on a CPU (megatron-core needs two shims there: its global memory buffer asks
``torch.cuda.current_device()``, and its RNG tracker forks CUDA states; Megatron's torch_dist writer calls
``torch.cuda.synchronize()`` and is skipped)::

    python benchmarks/gpu_megatron.py --dir /tmp/megatron-bench [--device cuda] [--layers 8 --hidden 1024] [--reps 3]

On the GPU machine it needs megatron-core (``pip install --no-deps megatron-core==0.16.1``: a wheel in .whl/,
benchmarks/gpu_session.sh step 9).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoints go (removed afterwards)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from alpsck.integrations import megatron as alpsck_megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    if a.device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        torch.cuda.set_device(0)
        tensor_parallel.model_parallel_cuda_manual_seed(123)
    alpsck_megatron.install()
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=max(1, a.hidden // 128),
                            use_cpu_initialization=a.device == "cpu", params_dtype=torch.float32)

    def model() -> Any:
        m = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32000,
                     max_sequence_length=512)
        return m.to(a.device)

    torch.manual_seed(0)
    source = model()
    nbytes = sum(p.numel() * p.element_size() for p in source.parameters())
    methods = {"alpsck": alpsck_megatron.save_strategy()}
    if a.device == "cuda":
        methods = {"torch_dist": None, **methods}  # Megatron's default first, then alpsck's, in every repetition
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in methods}
    a.dir.mkdir(parents=True, exist_ok=True)
    for rep in range(a.reps + 1):
        for name, strategy in methods.items():
            where = a.dir / f"{name}-iter_{rep:07d}"
            where.mkdir()
            sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            dist_checkpointing.save(source.sharded_state_dict(), str(where), sharded_strategy=strategy)
            saved = time.perf_counter() - t0
            into = model()
            sync()
            t0 = time.perf_counter()
            into.load_state_dict(dist_checkpointing.load(into.sharded_state_dict(), str(where)))
            sync()
            loaded = time.perf_counter() - t0
            for (k, p), q in zip(source.state_dict().items(), into.state_dict().values(), strict=True):
                if isinstance(p, torch.Tensor) and not torch.equal(p, q):
                    raise SystemExit(f"{name}: {k} loaded other values than it saved")
            if rep:  # rep 0: the warm-up
                times[name]["save"].append(saved)
                times[name]["load"].append(loaded)
            shutil.rmtree(where)
            del into
    result = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "parameter_bytes": nbytes,
              "reps": a.reps, "median_s": {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}}
    print(f"{result['device']}: a {a.layers}-layer GPT, hidden {a.hidden}, {nbytes / 2**30:.2f} GiB of parameters, "
          f"median of {a.reps}")
    for name, med in result["median_s"].items():
        print(f"  {name:<10} save {med['save']:7.3f} s   load {med['load']:7.3f} s   bit-exact")
    if "torch_dist" in result["median_s"]:
        d, x = result["median_s"]["torch_dist"], result["median_s"]["alpsck"]
        print(f"  alpsck/torch_dist: save {x['save'] / d['save']:.2f}, load {x['load'] / d['load']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
