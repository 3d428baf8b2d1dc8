"""One timed training step of the example GPT on one device, for bench/dispatch.py; run as a
script it is the plain-CUDA baseline's worker process.

Note [CUDA baseline in its own process]
With torch 2.11 (the H100 machine's; later versions not checked), registering a PrivateUse1
device makes ``at::getAccelerator()`` name it instead of CUDA, and from then on every backward
over plain CUDA tensors in that process trips ``opt_ready_stream && opt_parent_stream`` in the
autograd engine (pytorch/pytorch#161129). So the plain-CUDA training steps run in a child
process that never imports superchip. The parent still interleaves: it asks the child for a few
steps of one case at a time over a pipe, in turn with its own cases.

    python bench/step_case.py '{"n_layer": 4, ...}'   # reads case names, answers "wall cpu"
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from data import CharTokenizer, TEXT, get_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def synchronize(device: str) -> None:
    if device.startswith("superchip"):
        torch.superchip.synchronize()
    elif device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(cfg_args: dict) -> tuple[GPT, torch.Tensor]:
    """The benchmark's model (seeded, so parent and worker build the same one) and its data."""
    tok = CharTokenizer(TEXT)
    cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=cfg_args["seq_len"],
                    n_layer=cfg_args["n_layer"], n_head=cfg_args["n_head"],
                    d_model=cfg_args["d_model"])
    torch.manual_seed(0)
    return GPT(cfg), tok.encode(TEXT)


class StepCase:
    """A model, its AdamW and a batch stream on one device; ``__call__`` times some steps."""

    def __init__(self, model: GPT, device: str, data: torch.Tensor, batch: int, steps: int,
                 math_sdpa: bool = False, compiled: bool = False):
        self.device = device
        self.model = copy.deepcopy(model).to(device)
        self.fn = torch.compile(self.model) if compiled else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.data, self.batch, self.steps = data, batch, steps
        self.gen = torch.Generator().manual_seed(0)
        self.math_sdpa = math_sdpa

    def step(self) -> None:
        x, y = get_batch(self.data, self.batch, self.model.cfg.seq_len, self.gen)
        _, loss = self.fn(x.to(self.device), y.to(self.device))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        loss.item()

    def __call__(self) -> tuple[float, float]:
        """Seconds per step: (wall clock, this process's CPU time)."""
        ctx = sdpa_kernel([SDPBackend.MATH]) if self.math_sdpa else contextlib.nullcontext()
        with ctx:
            synchronize(self.device)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(self.steps):
                self.step()
            synchronize(self.device)
        return ((time.perf_counter() - t0) / self.steps,
                (time.process_time() - c0) / self.steps)


# name -> StepCase options; bench/compile.py asks for its own (compiled and eager plain CUDA)
CUDA_CASES = {"cuda": {}, "cuda, math sdpa": {"math_sdpa": True}}


class RemoteStepCase:
    """A StepCase of CUDA_CASES run by the worker process; same ``step()`` and ``__call__``."""

    def __init__(self, worker: "CudaWorker", name: str):
        self.worker, self.name = worker, name

    def step(self) -> None:
        self.worker.ask(f"step {self.name}")

    def __call__(self) -> tuple[float, float]:
        wall, cpu = self.worker.ask(f"time {self.name}").split()
        return float(wall), float(cpu)


class CudaWorker:
    """The child process of Note [CUDA baseline in its own process]."""

    def __init__(self, cfg_args: dict, cases: dict | None = None):
        self.names = list(cases or CUDA_CASES)
        env_cfg = json.dumps(dict(cfg_args, cases=cases or CUDA_CASES))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), env_cfg],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"bench: the CUDA baseline worker did not start (said {ready!r})")

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        if not reply or reply.startswith("error"):
            raise RuntimeError(f"bench: the CUDA baseline worker failed on {line!r}: {reply!r}")
        return reply

    def cases(self) -> dict:
        return {name: RemoteStepCase(self, name) for name in self.names}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _worker(cfg_args: dict) -> None:
    model, data = build_model(cfg_args)
    cases = {name: StepCase(model, "cuda", data, cfg_args["batch"], cfg_args["steps_per_rep"], **opts)
             for name, opts in cfg_args["cases"].items()}
    print("ready", flush=True)
    for line in sys.stdin:
        verb, name = line.strip().split(" ", 1)
        try:
            if verb == "step":
                cases[name].step()
                print("ok", flush=True)
            else:
                wall, cpu = cases[name]()
                print(f"{wall!r} {cpu!r}", flush=True)
        except Exception as e:  # reported to the parent, which raises it
            print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
