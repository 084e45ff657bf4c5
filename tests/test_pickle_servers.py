"""FlowGRPO's pickle reward servers (GenEval, DeQA, UnifiedReward): a GenEval-protocol server on loopback, written
here from FlowGRPO's protocol (yifan123/reward-server app_geneval.py: POST / with a pickled dict, JPEG images, the
prompts' metadata records, ``only_strict``; a pickled dict of ``scores`` and the accuracies back, HTTP 500 with the
traceback on a failure), scores through lean's client, as do DeQA's and UnifiedReward's formats; the opt-in and the
loopback rule are config errors; bad answers are retried and end in one RewardServerError line."""

import http.server
import io
import json
import os
import pickle
import time
import traceback
from collections import defaultdict

import numpy as np
import pytest
import torch
from helpers import QuietHandler, free_port, http_server, tiny
from PIL import Image
from safetensors.torch import load_file

from lean.cli import main
from lean.config import ConfigError
from lean.config.prompts import MetadataPrompt, prompt_metadata, read_prompts
from lean.rewards import RewardServerError
from lean.rewards.options import PickleServerConfig
from lean.rewards.pickle_servers import PickleServerReward, chunks, load_answer
from lean.train import train

GENEVAL_TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
RECORDS = [
    {"tag": "color_attr", "include": [{"class": "giraffe", "count": 1, "color": "brown"}], "prompt": "a brown giraffe"},
    {"tag": "counting", "include": [{"class": "cat", "count": 3}], "exclude": [{"class": "cat", "count": 4}],
     "prompt": "a photo of three cats"},
]  # fmt: skip


def brightness(jpeg: bytes) -> float:
    """What the test servers score: the mean of the decoded JPEG, in [0, 1]."""
    with Image.open(io.BytesIO(jpeg), formats=["jpeg"]) as image:
        return float(np.asarray(image.convert("RGB"), dtype=np.float64).mean() / 255)


def geneval_answer(request: dict) -> dict:
    """reward_server/gen_eval.py compute_geneval's layout: the partial ``scores`` (here brightness x the number of
    include clauses), 0/1 accuracies, and per tag the sample's accuracy or -10 for the other tags."""
    scores, strict, rewards = [], [], []
    groups, strict_groups = defaultdict(list), defaultdict(list)
    for jpeg, metadata in zip(request["images"], request["meta_datas"], strict=True):
        scores.append(brightness(jpeg) * len(metadata["include"]))
        strict.append(float(scores[-1] > 0.5))
        rewards.append(0.0 if request["only_strict"] else strict[-1])
        for tag in GENEVAL_TAGS:
            groups[tag].append(rewards[-1] if tag == metadata["tag"] else -10.0)
            strict_groups[tag].append(strict[-1] if tag == metadata["tag"] else -10.0)
    return {
        "scores": scores,
        "rewards": rewards,
        "strict_rewards": strict,
        "group_rewards": dict(groups),
        "group_strict_rewards": dict(strict_groups),
    }


def outputs_answer(request: dict) -> dict:
    """DeQA's and UnifiedReward's layout: ``outputs``, one number per image (numpy floats, as a server may send)."""
    return {"outputs": np.array([brightness(j) for j in request["images"]])}


class PickleServer(QuietHandler, http.server.BaseHTTPRequestHandler):
    """FlowGRPO's server loop: unpickle the request, ``server.score`` it, pickle the answer; a failure is HTTP 500
    with the traceback. ``server.answer`` (status, body), when set, replaces the answer; every request is kept."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        request = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))  # the test trusts lean's client
        self.server.requests.append(request)
        time.sleep(self.server.delay_s)
        try:
            status, answer = self.server.answer or (200, pickle.dumps(self.server.score(request)))
        except Exception:
            status, answer = 500, traceback.format_exc().encode()
        self.reply(status, answer)


@pytest.fixture
def server():
    with http_server(PickleServer, requests=[], delay_s=0.0, answer=None, score=geneval_answer) as server:
        yield server


def url_of(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def settings(url: str, **fields) -> PickleServerConfig:
    entry = PickleServerConfig(url=url, allow_pickle=True, **fields)
    entry.validate("reward.pickle_servers.x")
    return entry


def images_of(count: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def expected_jpeg_brightness(images: torch.Tensor) -> torch.Tensor:
    """What the servers see: each image as FlowGRPO's client sends it (8 bits, PIL's JPEG at its default quality)."""
    from lean.rewards.builtin import to_uint8
    from lean.rewards.pickle_servers import encode_jpeg

    return torch.tensor([brightness(encode_jpeg(a)) for a in to_uint8(images)], dtype=torch.float64)


def test_geneval_scores_through_the_client_with_each_prompts_metadata(server):
    prompts = [MetadataPrompt(r["prompt"], r) for r in RECORDS] * 3  # 6 images in requests of 3, 3 (batch_size 4)
    images = images_of(6)
    reward = PickleServerReward("geneval", settings(url_of(server), batch_size=4))
    scores = reward(images, prompts)
    counts = torch.tensor([len(prompt_metadata(p)["include"]) for p in prompts], dtype=torch.float64)
    torch.testing.assert_close(scores, expected_jpeg_brightness(images) * counts, rtol=0, atol=1e-12)
    assert [len(r["images"]) for r in server.requests] == [3, 3]  # np.array_split's near-equal parts
    assert all(r["only_strict"] is True and set(r) == {"images", "meta_datas", "only_strict"} for r in server.requests)
    assert [m for r in server.requests for m in r["meta_datas"]] == RECORDS * 3
    # a video: each frame scored with its sample's metadata, the mean over the frames
    video = torch.rand(2, 3, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    frames = video.permute(0, 2, 1, 3, 4).reshape(4, 3, 16, 16)
    per_frame = expected_jpeg_brightness(frames).view(2, 2).mean(1) * counts[:2]
    torch.testing.assert_close(reward(video, prompts[:2]), per_frame, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,fields", [("deqa", {"images"}), ("unifiedreward_remote", {"images", "prompts"})])
def test_deqa_and_unifiedreward_round_trips(server, name, fields):
    server.score = outputs_answer
    images = images_of(3, seed=2)
    scores = PickleServerReward(name, settings(url_of(server)))(images, ["a", "b", "c"])
    torch.testing.assert_close(scores, expected_jpeg_brightness(images), rtol=0, atol=1e-12)
    assert set(server.requests[0]) == fields
    assert server.requests[0].get("prompts", ["a", "b", "c"]) == ["a", "b", "c"]
    assert all(bytes(j[:2]) == b"\xff\xd8" for j in server.requests[0]["images"])  # JPEG


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "answer,delay_s,problem,requests",
    [
        ((200, b"\x80\x04junk"), 0, "the answer is not a pickle", 3),
        ((200, pickle.dumps({"scores": [1.0]})), 0, r"need 2 numbers under 'scores', got \[1.0\]", 3),
        ((200, pickle.dumps(["a", "b"])), 0, "need a dict with 'scores'", 3),
        ((500, b"Traceback (most recent call last):\n  File x\nKeyError: 'meta_datas'\n"), 0, "HTTP 500 KeyError", 3),
        (None, 1.0, "timed out", 3),
        ((200, pickle.dumps({"scores": [os.getcwd, 1]})), 0, "names posix.getcwd, which the restricted", 1),
    ],
)
def test_a_bad_answer_is_retried_and_ends_in_one_line(server, answer, delay_s, problem, requests):
    server.answer, server.delay_s = answer, delay_s
    url = url_of(server)
    reward = PickleServerReward("geneval", settings(url, timeout_s=0.3, retries=2, backoff_s=0.01))
    with pytest.raises(RewardServerError, match=rf"^reward geneval: server {url}: .*{problem}") as err:
        reward(images_of(2), [MetadataPrompt(r["prompt"], r) for r in RECORDS])
    assert "\n" not in str(err.value)
    assert len(server.requests) == requests


def test_a_server_that_is_down_is_retried():
    url = f"http://127.0.0.1:{free_port()}"
    reward = PickleServerReward("deqa", settings(url, retries=1, backoff_s=0.01))
    with pytest.raises(RewardServerError, match=rf"^reward deqa: server {url}: .*Connection.*after 2 attempt"):
        reward(images_of(1), ["a"])


def test_the_unpickler_builds_plain_data_and_numpy_only():
    plain = {"scores": [1, 2.5], "n": np.float32(0.5), "a": np.arange(3), "s": {1}, "t": ("x", None)}
    assert load_answer(pickle.dumps(plain))["a"].tolist() == [0, 1, 2]
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        load_answer(pickle.dumps(eval))
    assert [len(c) for c in chunks(130, 64)] == [44, 43, 43]  # FlowGRPO's np.array_split(..., ceil(130 / 64))


def test_the_opt_in_and_the_loopback_rule_are_config_errors():
    base = ["reward.weights={deqa: 1.0}", "reward.pickle_servers.deqa.url=http://127.0.0.1:18086"]
    with pytest.raises(ConfigError, match=r"^config error: reward.pickle_servers.deqa.allow_pickle=False: .*pickle"):
        tiny(*base)
    tiny(*base, "reward.pickle_servers.deqa.allow_pickle=true")
    remote = ["reward.weights={deqa: 1.0}", "reward.pickle_servers.deqa.url=http://10.1.2.3:18086"]
    remote.append("reward.pickle_servers.deqa.allow_pickle=true")
    with pytest.raises(ConfigError, match=r"10.1.2.3 is not loopback.*reward.pickle_servers.deqa.allow_host"):
        tiny(*remote)
    with pytest.raises(ConfigError, match=r"rewards.example is not loopback"):
        tiny(*remote, "reward.pickle_servers.deqa.url=http://rewards.example:1")
    assert (
        tiny(*remote, "reward.pickle_servers.deqa.allow_host=10.1.2.3").reward.pickle_servers["deqa"].batch_size == 64
    )
    with pytest.raises(ConfigError, match=r"reward.pickle_servers key='gen_eval'.*did you mean 'geneval'"):
        tiny("reward.pickle_servers.gen_eval.url=http://[::1]:1", "reward.pickle_servers.gen_eval.allow_pickle=true")
    with pytest.raises(
        ConfigError, match=r"reward.weights.geneval=1.0: geneval is FlowGRPO's server: set reward.pickle_servers"
    ):
        tiny("reward.weights={geneval: 1.0}")
    geneval = ["reward.weights={geneval: 1.0}", "reward.pickle_servers.geneval.url=http://localhost:18085"]
    with pytest.raises(ConfigError, match=r"^config error: train.prompts_file=None: prompt .* has no GenEval metadata"):
        tiny(*geneval, "reward.pickle_servers.geneval.allow_pickle=true")


def test_jsonl_records_travel_with_their_prompts(tmp_path):
    path = tmp_path / "train_metadata.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*RECORDS, {"prompt": "plain"}]) + "\n")
    prompts = read_prompts(path)
    assert prompts == ["a brown giraffe", "a photo of three cats", "plain"]
    assert [prompt_metadata(p) for p in prompts] == [*RECORDS, None] and type(prompts[2]) is str
    assert [prompt_metadata(p) for p in pickle.loads(pickle.dumps(prompts))] == [*RECORDS, None]


@pytest.mark.timeout(120)
def test_lean_train_sends_each_prompts_metadata_and_keeps_a_rollout_the_server_fails(server, tmp_path, capsys):
    """One iteration of a tiny run whose reward is the GenEval server: every sample reaches it with its record; the
    server fails, the rollout is kept with the records, and ``lean reward score`` re-scores it once the server is
    back."""
    path = tmp_path / "train_metadata.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    sets = ["reward.weights={geneval: 1.0}", f"reward.pickle_servers.geneval.url={url_of(server)}"]
    sets += ["reward.pickle_servers.geneval.allow_pickle=true", f"train.prompts_file={path}"]
    cfg = tiny(*sets, "reward.pickle_servers.geneval.retries=0", "sample.num_steps=2")
    server.answer = (503, b"overloaded")
    with pytest.raises(RewardServerError, match=r"reward geneval: .*HTTP 503 overloaded"):
        train(cfg, out=str(tmp_path / "run"))
    sent = [m for r in server.requests for m in r["meta_datas"]]
    assert len(sent) == cfg.samples_per_iteration and all(m in RECORDS for m in sent)

    server.answer = None
    rollout = tmp_path / "run" / "failed_rollouts" / "0.safetensors"
    capsys.readouterr()
    score = ["reward", "score", "--rollout", str(rollout), "--params", "/dev/null", "--device", "cpu"]
    assert main([*score, *(a for s in sets for a in ("--set", s))]) == 0
    scores = json.loads(capsys.readouterr().out)
    kept = json.loads(rollout.with_suffix(".json").read_text())
    counts = torch.tensor([len(m["include"]) for m in kept["metadata"]], dtype=torch.float64)
    expected = expected_jpeg_brightness(load_file(rollout)["images"]) * counts
    torch.testing.assert_close(torch.tensor(scores["geneval"], dtype=torch.float64), expected, rtol=0, atol=1e-12)
    assert [r["prompt"] for r in kept["metadata"]] == kept["prompts"]
