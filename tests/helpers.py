"""What the tests share: a fast run config."""

from __future__ import annotations

from lean.config import RunConfig
from lean.configure import load_config

FAST = [
    "train.prompts_per_iteration=2",
    "train.group_size=2",
    "train.rollout_batch_size=4",
    "train.train_batch_size=4",
    "sample.num_steps=4",
    "train.iterations=1",
]

# The README's CPU run of a preset: tiny model, 2 prompts x 4, 64 px, 16 T5 tokens, 1 iteration.
QUICK = [
    "model.size=tiny",
    "model.resolution=64",
    "model.text_max_length=16",
    "train.prompts_per_iteration=2",
    "train.group_size=4",
    "train.iterations=1",
]


def tiny(*overrides: str) -> RunConfig:
    """A fast run config: tiny model, 4 steps, 2 prompts x 2 samples."""
    return load_config(None, [*FAST, *overrides])


def tiny_preset_sets(name: str) -> list[str]:
    """The ``--set`` values that shrink the preset ``name`` to a CPU batch (:func:`tiny_preset`); an edit preset's
    own reference side (``model.reference_resolution``) to 64 px, the smallest the FLUX.2 pipelines take."""
    import yaml

    from lean.config.presets import PRESETS

    edits = (yaml.safe_load(PRESETS[name].read_text()).get("model") or {}).get("reference_resolution") is not None
    return [
        "model.size=tiny",
        "model.dtype=float32",
        "model.resolution=32",
        *(["model.reference_resolution=64"] if edits else []),
        "model.text_max_length=8",
        "model.num_frames=5",
        "train.prompts_per_iteration=2",
        f"train.group_size={3 if name == 'dancegrpo-flux' else 2}",
        "train.rollout_batch_size=8",
        "train.train_batch_size=8",
    ]


def tiny_preset(name: str, *overrides: str) -> RunConfig:
    """``name`` at tiny size on a CPU batch: 2 prompts x 2 samples (x 3 for DanceGRPO), 32 px, 8 T5 tokens, 5 video
    frames, float32 (bfloat16 matmuls are slow on CPUs); the preset's steps, SDE, guidance, LoRA and optimizer
    settings stay."""
    return load_config(None, [*tiny_preset_sets(name), *overrides], preset=name)


# What every test process imports (seconds per process: torch, diffusers with peft and transformers). `spawn` forks
# its processes from one server per pytest worker that imported these once, instead of starting each afresh.
PRELOAD = ["torch", "torch.distributed", "diffusers.models.transformers", "lean.models.policy", "lean.parallel.overlap"]


def spawn(fn, world: int, *args, deadline_s: float) -> None:
    """Runs ``fn(rank, world, port, *args)`` on ``world`` processes (torch.multiprocessing, forked from a clean
    single-threaded server that has :data:`PRELOAD` imported); kills them all if they outlive the deadline."""
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: at this worker's first spawn
    ctx = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world} test processes still running after {deadline_s}s")


def lean_ranks(world: int, *args: str, deadline_s: float = 280) -> None:
    """``lean launch -n world -- <args>`` without the launchers: ``world`` gloo ranks forked from the preloaded
    server (:func:`spawn`), each running ``lean <args>`` in the test's folder and environment, with the variables
    Accelerate's launcher gives a CPU rank (``torchrun``'s RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, and
    ACCELERATE_USE_CPU). A rank process then starts in a fraction of a second instead of several: the launch path
    itself is tested where it matters (tests/test_distributed.py, test_reliability.py, the smoke's overlap stage)."""
    import os

    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    spawn(_lean_rank, world, env, os.getcwd(), list(args), deadline_s=deadline_s)


def _lean_rank(rank: int, world: int, port: int, env: dict, cwd: str, args: list[str]) -> None:
    import os

    import torch

    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(cwd)
    torch.set_num_threads(1)
    from lean.cli import main

    code = main(args)
    if code:
        raise SystemExit(f"rank {rank}: lean {' '.join(args)} exited with {code}")


def lean_here(*args: str) -> None:
    """``lean <args>`` on one process, run in this test's process: a separate one would spend its first seconds on
    the imports this one has done (the reference runs that multi-process runs are compared with)."""
    from lean.cli import main

    assert main(list(args)) == 0, f"lean {' '.join(args)} failed"


def python() -> str:
    """The interpreter a test starts processes with: the warm one (``tests/warm_python.py``, set up by conftest for
    the session) or, without it, this one."""
    import os
    import sys

    return os.environ.get("LEAN_TEST_PYTHON", sys.executable)


def cold_env() -> dict[str, str]:
    """This environment without the warm shims: every process a test starts is a real child of its parent, as a
    test that walks the process tree (``ps --ppid``) needs."""
    import os

    env = dict(os.environ)
    warm = env.pop("LEAN_TEST_PYTHON", None)
    if warm:
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != os.path.dirname(warm))
    return env


def venv_path() -> str:
    """PATH with this interpreter's folder (``lean``, ``dvc``, ``accelerate``) ahead of the system's, and the warm
    shims, where the session has them, ahead of both."""
    import os
    import sys

    venv = os.path.dirname(sys.executable)
    path = os.environ["PATH"]
    return path if venv in path.split(os.pathsep) else os.pathsep.join([venv, path])


def served(cmd: list[str], port: int, health: dict, env: dict | None = None, what: str = "the server"):
    """Starts ``cmd`` (a server on ``port``, in its own process group), waits up to 90 s until ``GET /health``
    answers ``health``, yields its URL, then stops the group (a context manager: use it in a fixture)."""
    import contextlib
    import json
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    @contextlib.contextmanager
    def running():
        process = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 90
            while True:
                assert process.poll() is None, process.stdout.read().decode()
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                        assert json.load(answer) == health
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"{what} did not answer /health within 90 s"
                    time.sleep(0.3)
            yield url
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=20)
            process.stdout.close()

    return running()


class QuietHandler:
    """A mix-in for the tests' ``http.server`` handlers: :meth:`reply` sends a status and body (a client that gave
    up, timed out, is no error), and nothing is logged."""

    def reply(self, status: int, body: bytes) -> None:
        try:
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up (timed out)
            pass

    def log_message(self, *args):
        pass


def http_server(handler, **attributes):
    """A ``ThreadingHTTPServer`` on a free 127.0.0.1 port serving ``handler`` in a thread, with ``attributes`` set on
    it (what the handler reads and counts); a context manager that shuts it down."""
    import contextlib
    import http.server
    import threading

    @contextlib.contextmanager
    def running():
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        for name, value in attributes.items():
            setattr(server, name, value)
        # polled every 20 ms: shutdown() waits one poll interval (0.5 s by default) at every test's end
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        thread.start()
        try:
            yield server
        finally:
            server.shutdown()
            server.server_close()

    return running()


def free_port() -> int:
    """A TCP port nothing listens on (now) on 127.0.0.1, below the kernel's ephemeral range (32768-60999): a port
    bind(0) hands out may be taken, before the test's server binds it, by any outgoing connection of the other
    workers' processes (a rank's TCPStore then failed with EADDRINUSE); a random one below that range is not."""
    import random
    import socket

    for _ in range(100):
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


CLIP_PROMPTS = ["a red circle on a white background", "a blue square on the left", "a photo", "a cat"]


def save_tiny_clip(folder, projection_dim: int = 16, image_size: int = 32, head: bool = True):
    """A randomly initialised CLIP folder as the model rewards read it (``lean.rewards.models``): config.json and
    model.safetensors (``CLIPModel.save_pretrained``), the repo's word-level tokenizer trained on
    :data:`CLIP_PROMPTS` (``lean.models.text.train_tokenizer``), a CLIPImageProcessor config and, with
    ``head``, a random LAION-format aesthetic head (``aesthetic_head.safetensors``). Returns ``folder``."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from lean.models.text import train_tokenizer
    from lean.rewards.models import aesthetic_head

    tok = train_tokenizer(CLIP_PROMPTS, max_length=16)
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={"vocab_size": len(tok), "max_position_embeddings": 16, **small, **ids},
        vision_config={"image_size": image_size, "patch_size": 8, **small},
        projection_dim=projection_dim,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        CLIPModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    crop = {"height": image_size, "width": image_size}
    CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=crop).save_pretrained(folder)
    if head:
        mlp = aesthetic_head(projection_dim)
        save_file(
            {f"layers.{k}": v.contiguous() for k, v in mlp.state_dict().items()},
            f"{folder}/aesthetic_head.safetensors",
        )
    return folder


def write_edit_prompts(folder, count: int = 2, size: int = 32) -> str:
    """An edit data set as FlowGRPO's edit scripts read it: ``folder/train_metadata.jsonl`` with ``prompt`` and
    ``image`` (a path relative to the folder), the images ``count`` solid-colour squares. Returns the file's path."""
    import json
    from pathlib import Path

    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    colours = [(200, 30, 30), (30, 30, 200), (30, 160, 30), (220, 200, 40)]
    lines = []
    for k in range(count):
        Image.new("RGB", (size, size), colours[k % len(colours)]).save(folder / "images" / f"{k}.png")
        lines.append(json.dumps({"prompt": "make it snowy" if k % 2 else "add a red cube", "image": f"images/{k}.png"}))
    path = folder / "train_metadata.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def sets(*values: str) -> list[str]:
    """``--set`` arguments of a CLI call, one pair per ``key=value``."""
    return [a for v in values for a in ("--set", v)]


def renorm(v_u, v_c, s):
    """Qwen-Image's true CFG (QwenImagePipeline, QwenImageEditPipeline): v_u + s (v_c - v_u), rescaled per token to
    the norm of v_c."""
    import torch

    v = v_u + s * (v_c - v_u)
    return v * (torch.linalg.vector_norm(v_c, dim=-1, keepdim=True) / torch.linalg.vector_norm(v, dim=-1, keepdim=True))


def train_every_schedule(root, family: str, evaluated: tuple[str, ...] = ()) -> dict:
    """``lean train`` (the CLI, :data:`FAST`, one iteration) of ``family`` with each schedule under ``root``; the
    schedules in ``evaluated`` also evaluate (every iteration, one sample per prompt). Returns schedule -> folder."""
    from lean.cli import main

    out = {}
    for schedule in ("recompute", "retain", "reweight"):
        out[schedule] = root / schedule
        extra = ["eval.every=1", "eval.samples_per_prompt=1"] if schedule in evaluated else []
        args = ["train", *sets(*FAST, f"model.family={family}", f"train.schedule={schedule}", *extra)]
        assert main([*args, "--out", str(out[schedule])]) == 0, schedule
    return out


# ---------------------------------------------------------------- the plan the docs show (README quotes it)

DOCUMENTED_PLAN = "$ lean plan --preset dancegrpo-flux --gpu-mem-gb 80"
"""The command whose printed table docs/parallelism.md shows ("Planning a GPU run from a laptop"): README quotes its
rows, and test_layout checks them against what the command prints now."""

PLAN_COLUMNS = ("schedule", "layout", "shard", "SP", "ckpt", "sync", "m", "offload", "resident", "step", "bwd")
PLAN_COLUMNS += ("decode", "held", "peak", "host", "moved", "exposed", "time", "fits")


def documented_plan_rows() -> list[dict[str, str]]:
    """The rows of the table docs/parallelism.md shows under :data:`DOCUMENTED_PLAN`, by column."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text(encoding="utf-8")
    block = text[text.index(DOCUMENTED_PLAN) :].split("```", 1)[0]
    rows = [line.split() for line in block.splitlines()]
    return [dict(zip(PLAN_COLUMNS, r)) for r in rows if r[:1] in (["recompute"], ["retain"], ["reweight"])]


# ---------------------------------------------------------------- what the preset and certificate tests read


def preset_value_lines(name: str) -> list[str]:
    """The lines of preset ``name``'s file that set a value (``key: value``, indented: not a section, not a comment)."""
    import re

    from lean.config.presets import PRESETS

    return [ln for ln in PRESETS[name].read_text().splitlines() if re.match(r"^\s+\w+:\s*[^\s#]", ln)]


def uncited(values: list[str], *allowed: str) -> list[str]:
    """The value lines without a comment citing their source, less those that start with one of ``allowed``."""
    return [ln for ln in values if "#" not in ln and not (allowed and ln.strip().startswith(allowed))]


def reference_gap(report: dict) -> float:
    """The largest relative norm difference of an equivalence report's schedules to its float64 reference."""
    return max(r["rel_norm_diff"] for r in report["reference"].values())
