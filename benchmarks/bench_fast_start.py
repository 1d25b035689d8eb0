"""Time to the first step and peak host memory per rank, starting a 1.1B Llama from a Hugging Face directory.

Writes, with transformers at random init (no hub), a Llama directory of TinyLlama-1.1B's shape
(22 layers, hidden 2048, 32 heads, 4 key/value heads, MLP 5632, vocabulary 32000: 1.10e9
parameters, 4.4 GB of fp32 safetensors) and a raw uint16 token file without ``data prepare``
metadata (``--token-gib``), then starts the job on each layout (dp1·tp2, dp2·pp2, and dp2 and
dp2·tp2 under ZeRO-3, gloo on the CPU, one thread per rank) twice:

* ``before``: the code paths of the commit before issue 33's fast starts, put back in each rank
  process: ``tensor.shard_param`` is the old ``shard(dense_value(...))`` (each tensor-parallel
  rank reads every dense tensor whole, then cuts its piece) and ``engine.scan_share`` returns
  None (every rank scans every id of every file);
  Under ZeRO-3 (``dp2z3``, ``dp2tp2z3``) ``zero3.shards_on_meta`` is made to say False, as
  before ``materialize_shards``: each rank materialises (reads) the whole model, or its whole
  tensor-parallel pieces, then FSDP2 shards it;
* ``after``: this tree (a rank reads only its slices, under ZeRO-3 only its FSDP2 shards' rows;
  the ranks split the scan of a file no record vouches for, rank 0 records it).

Each rank runs what ``meshtrain.trainer.worker`` runs before its first step (the spec completed
from ``config.json`` and checked, the process group, the mesh, the engine: dataset opened and
checked, model imported and sharded, optimizer) and then waits at a barrier; "time to first
step" is the wall time from the launch of the ranks to that barrier (every rank ready for step
1), and "peak host memory" each rank's ``VmHWM`` there.  No step runs: a step of a 1.1B model
adds gradients and AdamW's two moments (12 bytes per parameter on top of the 4 of the weights),
about 13 GB over the ranks, more than a small shared machine has; the start is what issue 33
item 6 is about.  Scan records are removed before every run, so each run scans from nothing.

Run: ``python benchmarks/bench_fast_start.py [--token-gib 1] [--layouts tp2,dp2pp2,dp2z3,dp2tp2z3]``
(``python -m benchmarks fast_start``); results in ``benchmarks/results/fast_start-<host>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.api import loading
from meshtrain.trainer import engine, launch
from meshtrain.trainer.interop import from_hf
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.parallel import pipeline, tensor, zero3

SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
"""TinyLlama-1.1B's config.json shape."""
LAYOUTS = {
    "tp2": {"data": 1, "pipeline": 1, "tensor": 2},
    "dp2pp2": {"data": 2, "pipeline": 2},
    "dp2z3": {"data": 2, "zeroStage": 3},
    "dp2tp2z3": {"data": 2, "tensor": 2, "zeroStage": 3},
}
"""The layouts issue 33 names, dp1·tp2 and dp2·pp2, and dp2 and dp2·tp2 under ZeRO-3 (FSDP2)."""
SMOKE = {
    **SHAPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
}
"""``--smoke``: the same script on a tiny model, to check it runs (results not written)."""
SEQ_LEN = 128


def write_model(directory: Path) -> None:
    """The Hugging Face directory, written by transformers in a child process (its 4.4 GB freed after)."""
    code = (
        "import sys, torch, transformers\n"
        "torch.manual_seed(0)\n"
        f"config = transformers.LlamaConfig(**{SHAPE!r})\n"
        "transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True)


def write_tokens(path: Path, gib: float) -> None:
    """Raw uint16 ids below the vocabulary, no metadata: what a job must scan."""
    count = int(gib * 2**30) // 2
    block = ((np.arange(1 << 22, dtype=np.int64) * 7919) % SHAPE["vocab_size"]).astype("<u2")
    with path.open("wb") as out:
        for start in range(0, count, len(block)):
            out.write(block[: min(len(block), count - start)].tobytes())


def spec(model_dir: Path, tokens: Path, layout: dict[str, int]) -> dict[str, Any]:
    """The job: the shape every spec states; key/value heads, MLP width, eps and RoPE from config.json."""
    data, stages = layout.get("data", 1), layout.get("pipeline", 1)
    micro_batches = 2 if stages > 1 else 1
    shape = json.loads((model_dir / "config.json").read_text())
    return {
        "model": {
            "family": "llama",
            "layers": shape["num_hidden_layers"],
            "hidden": shape["hidden_size"],
            "heads": shape["num_attention_heads"],
            "vocab": shape["vocab_size"],
            "seqLen": SEQ_LEN,
            "init": {"fromHF": str(model_dir)},
        },
        "parallelism": {
            **{"data": 1, "pipeline": 1, "tensor": 1},
            **layout,
            "microBatches": micro_batches,
        },
        "resources": {"gpusPerNode": data * stages * layout.get("tensor", 1)},
        "training": {
            "globalBatch": data * micro_batches,
            "microBatch": 1,
            "steps": 1,
            "precision": "fp32",
            "dataset": str(tokens),
            "tokenDtype": "uint16",
        },
    }


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def _whole_then_cut(
    model: gpt.GPT, name: str, param: torch.Tensor, spec: tensor.ShardSpec, rank: int, size: int
) -> torch.Tensor:
    """The parent commit's tensor-parallel import: the whole dense tensor read, then this rank's piece cut."""
    return tensor.shard(gpt.dense_value(model, name, param), spec, rank, size)


def import_main(model_dir: Path, mode: str, out: Path) -> None:
    """Tensor-parallel rank 0 of 2 building its pieces from the directory, alone (no process group):
    the import without the other ranks' noise; its time and VmHWM to ``out``."""
    torch.set_num_threads(1)
    if mode == "before":
        tensor.shard_param = _whole_then_cut
    raw = spec(model_dir, model_dir / "none.bin", LAYOUTS["tp2"])
    job = from_hf.check_spec(loading.parse_spec(raw))
    config = gpt.GPTConfig.from_shape(job.model.shape())
    with torch.device("meta"):
        model = llama.build(config)
    model.initial_weights = from_hf.HFWeights(model_dir, config)
    [chunk] = pipeline.split_model(model, stage=0, stages=1, virtual_stages=1)
    started = time.perf_counter()
    tensor.apply_tensor_parallel(chunk, tensor.TPContext(group=None, rank=0, size=2))  # type: ignore[arg-type]
    gpt.materialize(chunk)
    seconds = time.perf_counter() - started
    out.write_text(json.dumps({"import_s": seconds, "vm_hwm_gib": _vm_hwm_kib() / 2**20}))


def rank_main(raw: dict[str, Any], mode: str, out: Path, launched: float) -> None:
    """One rank: everything before the first step, then the barrier; its times and VmHWM to ``out``."""
    torch.set_num_threads(1)
    if mode == "before":  # the parent commit's paths (see the module docstring)
        tensor.shard_param = _whole_then_cut
        engine.scan_share = lambda device: None
        zero3.shards_on_meta = lambda chunks: False
    imported = time.time()
    job = from_hf.check_spec(loading.parse_spec(raw))
    mesh_mod.init_process_group(use_cuda=False)
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    joined = time.time()
    engine.Engine(job, mesh)
    built = time.time()
    dist.barrier()
    ready = time.time()
    record = {
        "rank": dist.get_rank(),
        "imports_s": imported - launched,
        "process_group_s": joined - imported,
        "engine_s": built - joined,
        "time_to_first_step_s": ready - launched,
        "vm_hwm_gib": _vm_hwm_kib() / 2**20,
    }
    out.write_text(json.dumps(record))
    dist.destroy_process_group()


def run_layout(raw: dict[str, Any], mode: str, world: int, work: Path) -> list[dict[str, Any]]:
    """Launch ``world`` rank processes (torchrun's environment) and collect their records."""
    port = launch.free_port()
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(raw))
    launched = time.time()
    procs = []
    for rank in range(world):
        env = {
            **launch.rank_env(rank, world, port, work / "logs", cuda=False),
            "MESHTRAIN_CACHE_DIR": str(work / "cache"),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, __file__, "--rank-of", str(spec_file), "--mode", mode]
        command += ["--out", str(work / f"rank-{rank}.json"), "--launched", repr(launched)]
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"{mode}: rank exit codes {codes}")
    return [json.loads((work / f"rank-{r}.json").read_text()) for r in range(world)]


def _clear_records(tokens: Path, work: Path) -> None:
    for sidecar in tokens.parent.glob(tokens.name + ".*"):
        sidecar.unlink()
    for record in (work / "cache").rglob("*.json"):
        record.unlink()


def _print(layout: str, mode: str, seconds: float, peaks: list[float]) -> None:
    shown = ", ".join(f"{p:.2f}" for p in peaks)
    print(f"{layout:<24} {mode:<6} {seconds:7.1f}s  VmHWM per rank {shown} GiB", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token-gib", type=float, default=1.0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--smoke", action="store_true", help="a tiny model; no results file")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per layout and mode, alternating"
    )
    parser.add_argument("--name", default="fast_start", help="results file name")
    parser.add_argument(
        "--import-alone", action="store_true", help="also time tp rank 0's import alone"
    )
    parser.add_argument("--import-of", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("before", "after"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        rank_main(json.loads(args.rank_of.read_text()), args.mode, args.out, args.launched)
        return 0
    if args.import_of:
        import_main(args.import_of, args.mode, args.out)
        return 0
    if args.smoke:
        SHAPE.update(SMOKE)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mt-fast-start-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        write_model(root / "hf")
        tokens = root / "tokens.bin"
        write_tokens(tokens, args.token_gib)
        print(
            f"wrote the model and {args.token_gib} GiB of tokens in {time.perf_counter() - started:.0f}s"
        )
        for name in filter(None, args.layouts.split(",")):
            layout = LAYOUTS[name]
            raw = spec(root / "hf", tokens, layout)
            world = layout.get("data", 1) * layout.get("pipeline", 1) * layout.get("tensor", 1)
            for repeat in range(args.repeats):
                for mode in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
                    _clear_records(tokens, root)
                    load = os.getloadavg()[0]
                    ranks = run_layout(raw, mode, world, root)
                    row = {
                        "layout": name,
                        "mode": mode,
                        "repeat": repeat,
                        "load_average_1m_before": load,
                        "time_to_first_step_s": max(r["time_to_first_step_s"] for r in ranks),
                        "peak_vm_hwm_gib_max_rank": max(r["vm_hwm_gib"] for r in ranks),
                        "ranks": ranks,
                    }
                    rows.append(row)
                    _print(
                        name, mode, row["time_to_first_step_s"], [r["vm_hwm_gib"] for r in ranks]
                    )
        for repeat in range(args.repeats if args.import_alone else 0):
            for mode in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
                out = root / "import.json"
                command = [sys.executable, __file__, "--import-of", str(root / "hf")]
                subprocess.run([*command, "--mode", mode, "--out", str(out)], check=True)
                alone = {"layout": "tp2-rank0-import-alone", "mode": mode, "repeat": repeat}
                alone |= json.loads(out.read_text())
                rows.append(alone)
                _print(alone["layout"], mode, alone["import_s"], [alone["vm_hwm_gib"]])
    if args.smoke:
        return 0
    results = {
        "shape": SHAPE,
        "parameters": 1_100_048_384,
        "seq_len": SEQ_LEN,
        "token_file_gib": args.token_gib,
        "before": "the parent commit's paths put back in each rank (whole-tensor reads then cut; "
        "every rank scans every token), see the module docstring",
        "rows": rows,
    }
    path = machine.write_results(args.name, results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
