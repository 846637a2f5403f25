"""The largest model on one GPU: memtrain's placement (``backend.offload auto``) beside the stock
DeepSpeed optimizer-offload config, Llama shapes, bf16, sequence 1024, at the recipe's global batch
(``recipes/llama_10b.yaml``: 64 sequences) or ``--global_batch_size``.

    python benchmarks/largest_model.py --plan [--results]                 # predictions only, any machine
    python benchmarks/largest_model.py --plan --shapes 13b --extra "--memory.allow_lossy_levers true --memory.levers auto"
    python benchmarks/largest_model.py --shapes 6.7b,10b [--results]      # one GPU: 8 steps each, alternating
    python benchmarks/largest_model.py --shapes 3b,6.7b,10b --global_batch_size 16 --budget_s 180   # the GPU suite's
    python benchmarks/largest_model.py --device cpu --shapes tiny         # the same code path on a CPU

``--plan`` prints, per shape, ``memtrain plan``'s placements for ``--gpu_memory_gib`` /
``--host_memory_gib`` (default 80 / 128: one H100 and the host it was measured with). Training
mode holds each run to those limits on a GPU (``memory.cuda_memory_cap_gib`` and
``memory.host_memory_gib``: a larger GPU or host is planned and run as the claimed one), runs
each configuration ``--repeats`` times, alternating, and writes a ``run`` row as each run ends (a
run cut by a time limit loses only itself): tokens/s of the steady steps (from the third on), TFLOP/s,
the GPU peak (``peak_memory_bytes`` of metrics.jsonl) and the host peak (the resident set of the
run's processes, sampled every 0.2 s), next to the placement's predicted peaks; then one row per
shape with min/median/max over the repeats.

On a GPU each run is first looked up in the committed ``--plan`` rows of its shape for the claimed
machine and global batch: a configuration that does not fit there (the stock config's whole
optimizer state on a 128 GiB host from 6.7B on) is not started and its row says why, and with
``--budget_s`` a run predicted (start-up allowance plus the plan's step time) not to end in the
time left is not started either, so a time limit never cuts a run and every row is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from typing import Optional

import yaml

from common import REPO, RunFailed, emit, run_cli, run_memtrain, scratch_dir, spread

SHAPES = {  # hidden, intermediate, layers, heads (OpenLLaMA 3B, Llama-2 7B and 13B, recipes/llama_10b.yaml between)
    "tiny": (64, 172, 2, 4),
    "3b": (3200, 8640, 26, 32),
    "6.7b": (4096, 11008, 32, 32),
    "10b": (5120, 13824, 31, 40),
    "13b": (5120, 13824, 40, 40),
}
CONFIGS = {
    "memtrain": ["--backend.offload", "auto"],
    "stock_optimizer_offload": ["--backend.deepspeed_config", str(REPO / "ds_configs" / "zero3_offload.json"),
                                "--backend.offload", "optimizer"],
}
STOCK_PLACEMENT = "zero3 optimizer→host"
"""The row of ``memtrain plan``'s placement table that the stock config is (ZeRO-3, the whole
optimizer state on the host)."""
PLAN_ROWS = REPO / "benchmarks" / "results" / "largest_model_plan-cpu.jsonl"
"""The committed plan rows a GPU run reads its predictions from (``--plan --results`` writes them)."""
STARTUP_S = 40.0
"""Seconds a GPU run is allowed besides its steps: the process and CUDA start, the imports, reading
the data cache, the plan and building the model on the device, and the exit. A CPU rehearsal's
runs measure theirs (``startup_s`` of each ``run`` row) and the largest gives the next run's allowance."""


def shape_args(shape: str, device: str, steps: int) -> list[str]:
    hidden, ffn, layers, heads = SHAPES[shape]
    args = ["--config", str(REPO / "recipes" / "llama_10b.yaml"), "--model.config.hidden_size", str(hidden),
            "--model.config.intermediate_size", str(ffn), "--model.config.num_hidden_layers", str(layers),
            "--model.config.num_attention_heads", str(heads), "--model.config.num_key_value_heads", str(heads),
            "--training.max_steps", str(steps)]
    if device == "cpu":  # the tiny shape on a CPU: a small corpus and sequence, fp32
        args += ["--precision", "fp32", "--data.max_bytes", "300000", "--data.vocab_size", "512",
                 "--data.seq_len", "64", "--model.config.max_position_embeddings", "64"]
    return args


def plan(shape: str, gpu_gib: float, host_gib: float, extra: list[str]) -> dict:
    """``memtrain plan --json`` of ``shape`` (with the memtrain arguments ``extra``): the placement rows."""
    out = run_cli(["plan", *shape_args(shape, "cuda", 20), "--backend.offload", "auto", "--gpu_memory_gib",
                   str(gpu_gib), "--host_memory_gib", str(host_gib), *extra, "--json"], ok_codes=(0, 3))  # 3: nothing fits
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {"placements": [r for r in rows if r.get("placement")]}


class HostPeak:
    """The largest summed resident set of this process's children (and theirs), sampled."""

    def __init__(self, period_s: float = 0.2):
        import psutil

        self.me, self.period_s, self.peak, self._stop = psutil.Process(), period_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        import psutil

        while not self._stop.is_set():
            total = 0
            for child in self.me.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def plan_rows(gpu_gib: float, host_gib: float, batch: int, extra: str = "") -> dict[str, dict]:
    """``{shape: the latest committed plan row}`` for this machine, global batch and ``extra``."""
    rows = {}
    for line in PLAN_ROWS.read_text().splitlines() if PLAN_ROWS.exists() else []:
        row = json.loads(line)
        if (row.get("gpu_memory_gib"), row.get("host_memory_gib"), row.get("global_batch_size"),
                row.get("extra", "")) == (gpu_gib, host_gib, batch, extra):
            rows[row["shape"]] = row
    return rows


def planned(row: Optional[dict], config: str) -> Optional[dict]:
    """The placement ``config`` trains with in plan row ``row``: memtrain's chosen one, the stock
    config's :data:`STOCK_PLACEMENT` (None: no row, or memtrain's plan found none)."""
    if row is None:
        return None
    if config == "memtrain":
        return next((p for p in row["placements"] if p.get("chosen")), None)
    return next((p for p in row["placements"] if p["name"] == STOCK_PLACEMENT), None)


def refusal(placement: Optional[dict], gpu_gib: float, host_gib: float) -> Optional[str]:
    """Why ``placement`` cannot run on the claimed machine (None: it fits, or it is not known)."""
    if placement is None or (placement.get("fits_device", True) and placement.get("fits_host", True)):
        return None
    return (f"{placement['name']} needs {placement['device_bytes'] / 2**30:.1f} GiB of GPU and "
            f"{placement['host_bytes'] / 2**30:.1f} GiB of host; the claimed machine has {gpu_gib:g} and {host_gib:g}")


def predicted_run_s(placement: Optional[dict], steps: int, startup_s: float = STARTUP_S) -> Optional[float]:
    """Seconds a run of ``steps`` steps at ``placement`` is predicted to take on the GPU: its
    start-up allowance and the plan's step time (None: no plan row)."""
    return None if placement is None else startup_s + steps * placement["predicted_step_s"]


def predicted_seconds(shapes: list[str], steps: int, gpu_gib: float, host_gib: float, batch: int,
                      startup_s: float = STARTUP_S) -> float:
    """The predicted duration of a GPU run of these shapes (every configuration the claimed machine
    holds; refused ones cost nothing) from the committed plan rows.

    Raises:
        KeyError: a shape without a plan row for this machine and global batch.
    """
    rows = plan_rows(gpu_gib, host_gib, batch)
    total = 0.0
    for shape in shapes:
        for config in CONFIGS:
            placement = planned(rows[shape], config)
            if placement is not None and refusal(placement, gpu_gib, host_gib) is None:
                total += predicted_run_s(placement, steps, startup_s)
    return total


def recipe_global_batch_size() -> int:
    """``training.global_batch_size`` of ``recipes/llama_10b.yaml``."""
    with open(REPO / "recipes" / "llama_10b.yaml") as fh:
        return int(yaml.safe_load(fh)["training"]["global_batch_size"])


def limit_args(device: str, gpu_gib: float, host_gib: float) -> list[str]:
    """The memtrain arguments that hold a run to the claimed machine (none on a CPU rehearsal)."""
    if device != "cuda":
        return []
    return ["--memory.cuda_memory_cap_gib", str(gpu_gib), "--memory.host_memory_gib", str(host_gib)]


def train_once(shape: str, config: str, device: str, steps: int, extra: list[str]) -> dict:
    """One run of ``config`` at ``shape``: tokens/s, device and host peaks, memtrain's placement.
    No export (``checkpoint.export false``: ~20 GB for the 10B shape in bf16); its folder is removed after."""
    out = scratch_dir(f"largest-{shape}-{config}")
    try:
        return _train_in(out, shape, config, device, steps, extra)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _train_in(out: str, shape: str, config: str, device: str, steps: int, extra: list[str]) -> dict:
    started = time.perf_counter()
    with HostPeak() as host:
        try:
            records = run_memtrain([*shape_args(shape, device, steps), *CONFIGS[config], "--checkpoint.export", "false",
                                    *extra], out, nproc=1)
        except RunFailed as exc:
            said = [line for line in exc.stderr.splitlines() if line.startswith("memtrain:")]
            return {"failed": exc.returncode, "error": said[-1] if said else exc.stderr.strip()[-300:],
                    "wall_s": time.perf_counter() - started}
    wall_s = time.perf_counter() - started
    steady = records[2:] or records
    tokens_s = statistics.median(r["tokens_per_s"] for r in steady)
    with open(os.path.join(out, "summary.json")) as fh:
        n = json.load(fh).get("parameters")
    result = {"wall_s": wall_s, "startup_s": wall_s - records[-1]["elapsed_s"],  # all but the steps
              "tokens_per_s": tokens_s, "tflops": 6 * n * tokens_s / 1e12 if n else None,
              "gpu_peak_bytes": max(r["peak_memory_bytes"] for r in records), "host_peak_bytes": host.peak,
              "parameters": n, "plan": f"{records[-1]['micro_batch_size']}x{records[-1]['gradient_accumulation_steps']}"}
    placement = os.path.join(out, "placement.json")
    if os.path.exists(placement):  # memtrain's choice: its predicted peaks, to set beside the measured
        with open(placement) as fh:
            chosen = next((p for p in json.load(fh)["placements"] if p["chosen"]), {})
        result.update(placement=chosen.get("name"), predicted_device_bytes=chosen.get("device_bytes"),
                      predicted_host_bytes=chosen.get("host_bytes"))
    return result


class Budget:
    """Which runs to start: a configuration the claimed machine cannot hold by its committed plan
    row is not run (the row says why), nor a run predicted (:func:`predicted_run_s`, with the
    largest start-up measured so far, at least :data:`STARTUP_S`) not to end inside ``budget_s``.

    Args:
        budget_s: seconds from now (None: no limit); rows: :func:`plan_rows` (empty: no predictions).
    """

    def __init__(self, budget_s: Optional[float], rows: dict[str, dict]):
        self.ends = None if budget_s is None else time.perf_counter() + budget_s
        self.rows, self.startup_s = rows, STARTUP_S

    def why_not(self, shape: str, config: str, steps: int, gpu_gib: float, host_gib: float) -> Optional[str]:
        """Why the run is not started (None: start it)."""
        placement = planned(self.rows.get(shape), config)
        refused = refusal(placement, gpu_gib, host_gib)
        if refused:
            return f"refused by the plan: {refused}"
        predicted = predicted_run_s(placement, steps, self.startup_s)
        left = None if self.ends is None else self.ends - time.perf_counter()
        if left is not None and predicted is not None and predicted > left:
            return f"predicted {predicted:.0f} s, {left:.0f} s of the budget left"
        return None

    def ran(self, result: dict) -> dict:
        """``result`` of a run; its start-up seconds raise the next runs' allowance."""
        self.startup_s = max(self.startup_s, result.get("startup_s", 0.0))
        return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="store_true", help="predictions only (no GPU needed)")
    ap.add_argument("--shapes", default="6.7b,10b,13b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first two are left out of tokens/s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu_memory_gib", type=float, default=80)
    ap.add_argument("--host_memory_gib", type=float, default=128)
    ap.add_argument("--extra", default="", help="more memtrain arguments, space-separated")
    ap.add_argument("--global_batch_size", type=int, default=None, help="sequences per step (default: the recipe's)")
    ap.add_argument("--budget_s", type=float, default=None,
                    help="seconds this may take: a run predicted not to end inside what is left is not started "
                         "(a row says so); default: no limit")
    ap.add_argument("--results", action="store_true", help="append to benchmarks/results/")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    batch = args.global_batch_size or recipe_global_batch_size()
    # the memtrain arguments of every run and plan besides the shape's (a given global batch among them)
    given = [*args.extra.split(), *(["--training.global_batch_size", str(batch)] if args.global_batch_size else [])]
    if args.plan:
        for shape in shapes:
            emit("largest_model_plan", "cpu", {"shape": shape, "gpu_memory_gib": args.gpu_memory_gib,
                                                "host_memory_gib": args.host_memory_gib, "extra": args.extra,
                                                "global_batch_size": batch,
                                                **plan(shape, args.gpu_memory_gib, args.host_memory_gib, given)},
                 args.results)
        return 0
    extra = [*limit_args(args.device, args.gpu_memory_gib, args.host_memory_gib), *given]
    budget = Budget(args.budget_s, plan_rows(args.gpu_memory_gib, args.host_memory_gib, batch, args.extra)
                    if args.device == "cuda" else {})
    for shape in shapes:
        runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        for repeat in range(args.repeats):
            for config in CONFIGS:  # alternating: the machine's drift hits both alike
                why = budget.why_not(shape, config, args.steps, args.gpu_memory_gib, args.host_memory_gib)
                run = {"not_run": why} if why else budget.ran(train_once(shape, config, args.device, args.steps, extra))
                runs[config].append(run)
                emit("largest_model", args.device, {"run": True, "shape": shape, "config": config, "repeat": repeat,
                                                    "steps": args.steps, "global_batch_size": batch, **run},
                     args.results)
        result = {"shape": shape, "steps": args.steps, "repeats": args.repeats, "global_batch_size": batch,
                  "gpu_memory_gib": args.gpu_memory_gib if args.device == "cuda" else None,
                  "host_memory_gib": args.host_memory_gib if args.device == "cuda" else None}
        for config, rows in runs.items():
            ok = [r for r in rows if "failed" not in r and "not_run" not in r]
            result[config] = {"failed": [r for r in rows if "failed" in r or "not_run" in r]} if not ok else {
                "parameters": ok[0]["parameters"], "plan": ok[-1]["plan"], "placement": ok[-1].get("placement"),
                "predicted_device_bytes": ok[-1].get("predicted_device_bytes"),
                "predicted_host_bytes": ok[-1].get("predicted_host_bytes"),
                **{k: spread([r[k] for r in ok]) for k in ("tokens_per_s", "tflops", "gpu_peak_bytes", "host_peak_bytes")
                   if all(r[k] is not None for r in ok)}}
        ok = [(a, b) for a, b in zip(runs["memtrain"], runs["stock_optimizer_offload"])
              if "tokens_per_s" in a and "tokens_per_s" in b]
        if ok:
            result["ratio_tokens_per_s"] = spread([a["tokens_per_s"] / b["tokens_per_s"] for a, b in ok])
        emit("largest_model", args.device, result, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
