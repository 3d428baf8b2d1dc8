"""Runs a sweep's units in worker processes side by side, surviving units that crash them.

A sweep script lists its units (``units(shard)``: [(unit id, argument)] in a fixed order) and
checks one (``check(argument)`` -> a JSON-able result); run as ``script SHARD START OUT`` it
calls ``worker``. ``run_shards`` starts one worker per shard, each with one intra-op thread so
the shards share the cores; a unit that kills its worker gets ``crash_result(message)`` and the
shard goes on from the next unit in a fresh process. Results are keyed by unit id.
"""

from __future__ import annotations

import json
import subprocess
import sys


def worker(units, check, start: int, out_path: str) -> None:
    """Checks ``units[start:]``, one JSON line before and after each (flushed, so a crash
    loses nothing)."""
    import faulthandler

    import torch

    faulthandler.enable()
    torch.set_num_threads(1)  # the shards share the machine's cores
    with open(out_path, "a") as out:
        for k in range(start, len(units)):
            uid, arg = units[k]
            out.write(json.dumps({"k": k, "id": uid, "started": True}) + "\n")
            out.flush()
            res = check(arg)
            out.write(json.dumps({"k": k, "id": uid, "res": res}) + "\n")
            out.flush()


def _start(script: str, tag: str, shard: int, start: int, tmp_path) -> subprocess.Popen:
    # stderr goes to a file: a pipe could fill up while another shard is waited for.
    with open(tmp_path / f"{tag}{shard}.stderr", "w") as err:
        return subprocess.Popen([sys.executable, script, str(shard), str(start),
                                 str(tmp_path / f"{tag}{shard}.jsonl")],
                                stdout=subprocess.DEVNULL, stderr=err)


def run_shards(script: str, shards: int, tmp_path, crash_result, tag: str = "sweep") -> dict:
    """{unit id: result} over every shard of ``script``."""
    results: dict = {}
    procs = {shard: _start(script, tag, shard, 0, tmp_path) for shard in range(shards)}
    while procs:
        shard, proc = next(iter(procs.items()))
        proc.wait()
        del procs[shard]
        stderr = (tmp_path / f"{tag}{shard}.stderr").read_text(errors="replace")
        out_path = tmp_path / f"{tag}{shard}.jsonl"
        if not out_path.exists():
            raise RuntimeError(f"sweep worker failed to start:\n{stderr[-3000:]}")
        last_started = None
        for line in out_path.read_text().splitlines():
            rec = json.loads(line)
            if "res" in rec:
                results[rec["id"]] = rec["res"]
            else:
                last_started = rec
        if proc.returncode == 0:
            continue
        if last_started is None or last_started["id"] in results:
            raise RuntimeError(f"sweep worker died outside a unit:\n{stderr[-3000:]}")
        fatal = [ln for ln in stderr.splitlines() if ln.startswith("Fatal Python")]
        results[last_started["id"]] = crash_result(
            f"crashed the process (exit {proc.returncode}): {(fatal or [''])[0]}")
        procs[shard] = _start(script, tag, shard, last_started["k"] + 1, tmp_path)
    return results
