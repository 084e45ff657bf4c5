"""VLM judges over the OpenAI chat API, fake-free: ``lean reward serve --vlm`` serves a tiny random Qwen2-VL folder on
127.0.0.1, its answers constrained by ``guided_choice`` to UnifiedReward's ``Final Score: k``, and ``lean train``
trains one iteration against it. A judge that is down, slow, or answers junk or no score is retried, then one
RewardServerError line naming the endpoint (on which ``lean train`` keeps the rollout: test_reward_server)."""

import json
import os
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers import free_port, python, served, tiny
from test_reward_server import junk_server  # noqa: F401 (a fixture: a server answering what the test says)

from lean.cli import main
from lean.config import ConfigError
from lean.rewards import RewardServerError
from lean.rewards.groupwise import PairwiseWinRate, group_pairs
from lean.rewards.judge_templates import JUDGE_TEMPLATES, VLMJudgeConfig, parse_score
from lean.rewards.vlm_judge import VLMJudge, data_url
from lean.train import train

TOKEN_ENV = "LEAN_TEST_JUDGE_KEY"
SCORES = [f"Final Score: {k}" for k in range(1, 6)]  # UnifiedReward's answer, constrained
# UnifiedReward-Think's two verdicts (Pref-GRPO unifiedreward_think.py:100-101), constrained as the scores above
PAIRWISE_VERDICTS = ["<answer>Image 1 is better</answer>", "<answer>Image 2 is better</answer>"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
CHAT_TEMPLATE = (  # Qwen2-VL's, shortened: no system turn, no video
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A byte-level BPE of ~300 tokens with Qwen2-VL's chat and vision markers, built offline (Qwen2-VL's own needs the
    hub): any text round-trips, so the answers decode to what the chat template and the score pattern read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, initial_alphabet=alphabet)
    tok.train_from_iterator([" ".join(SCORES) + " user assistant"], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def save_tiny_vlm(folder) -> None:
    """A random Qwen2-VL (hidden 32, one layer, a one-block vision tower) and its processor, as save_pretrained writes
    them (images cut to at most 112 x 112 px: 4 merged patches)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    from lean.models.processors import make_processor
    from lean.models.spec import Processor

    tokenizer = tiny_tokenizer()
    markers = ("vision_start", "vision_end", "image_pad")
    ids = {f"{m}_token_id".replace("image_pad", "image"): tokenizer.convert_tokens_to_ids(f"<|{m}|>") for m in markers}
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    text |= dict(vocab_size=len(tokenizer), rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    text |= dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids)).save_pretrained(
        folder
    )
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    make_processor(
        Processor("Qwen2VLProcessor", "Qwen2VLImageProcessor", {}), tokenizer, image_processor
    ).save_pretrained(folder)


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    """``lean reward serve --vlm`` on the tiny folder with an API key, on a free port, in its own process group."""
    folder = tmp_path_factory.mktemp("tiny-qwen2-vl")
    save_tiny_vlm(folder)
    port = free_port()
    cmd = [python(), "-m", "lean.cli", "reward", "serve", "--vlm", str(folder), "--served-model-name", "judge"]
    cmd += ["--port", str(port), "--device", "cpu", "--token-env", TOKEN_ENV]
    env = {**os.environ, TOKEN_ENV: "s3cret"}
    with served(cmd, port, {"status": "ok", "model": "judge"}, env, "the VLM server") as url:
        yield url


def chat(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", "Bearer s3cret")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def judge(url: str, **settings) -> VLMJudge:
    settings = {"api_key_env": TOKEN_ENV, **settings}
    return VLMJudge("unifiedreward", VLMJudgeConfig(base_url=url, model="judge", guided_choice=SCORES, **settings))


@pytest.mark.timeout(150)
def test_the_served_vlm_answers_the_chat_api(vlm_server, monkeypatch):
    with urllib.request.urlopen(f"{vlm_server}/v1/models", timeout=10) as answer:
        assert [m["id"] for m in json.load(answer)["data"]] == ["judge"]
    image = {"type": "image_url", "image_url": {"url": data_url(torch.rand(3, 40, 40), None)}}
    body = {"model": "judge", "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Rate it."}]}]}
    answer = chat(vlm_server, {**body, "max_tokens": 3})
    free, used = answer["choices"][0], answer["usage"]["completion_tokens"]
    assert isinstance(free["message"]["content"], str)
    # 3 tokens at most: cut there ("length"), or the random model's end-of-text came first ("stop", sampled: the
    # image is unseeded, and a free answer's tokens are a draw)
    assert (free["finish_reason"], used) == ("length", 3) or (free["finish_reason"] == "stop" and used <= 3)
    for temperature, field in ((0, {"structured_outputs": {"choice": SCORES}}), (1, {"guided_choice": SCORES})):
        guided = chat(vlm_server, {**body, "temperature": temperature, **field})["choices"][0]  # greedy, sampled
        assert guided["message"]["content"] in SCORES and guided["finish_reason"] == "stop"
    remote = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    with pytest.raises(urllib.error.HTTPError, match="400") as err:
        chat(vlm_server, {"messages": [{"role": "user", "content": [remote]}]})
    assert "need a base64 data URL" in err.value.read().decode()
    # the reward: one request per image (videos: per frame), scores k / 5; a wrong key is not retried
    monkeypatch.setenv(TOKEN_ENV, "wrong")
    start = time.monotonic()
    with pytest.raises(
        RewardServerError, match=rf"^reward unifiedreward: server {vlm_server}/v1/chat/completions: HTTP 401"
    ):
        judge(vlm_server, backoff_s=5)(torch.rand(1, 3, 8, 8), ["a"])
    assert time.monotonic() - start < 5
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    scores = judge(vlm_server, concurrency=2, guided_choice_field="guided_choice")(
        torch.rand(3, 3, 32, 32), ["a cat", "a dog", "a cow"]
    )
    assert scores.dtype == torch.float64 and set(scores.tolist()) <= {0.2, 0.4, 0.6, 0.8, 1.0}
    assert judge(vlm_server)(torch.rand(1, 3, 2, 32, 32), ["a cat"]).shape == (1,)


@pytest.mark.timeout(200)
def test_lean_train_trains_against_the_served_judge(vlm_server, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    sets = ["reward.weights={unifiedreward: 1.0}", f"reward.judges.unifiedreward.base_url={vlm_server}"]
    sets += ["reward.judges.unifiedreward.model=judge", f"reward.judges.unifiedreward.guided_choice={SCORES}"]
    train(tiny(*sets, f"reward.judges.unifiedreward.api_key_env={TOKEN_ENV}"), out=str(tmp_path))
    header, row = (tmp_path / "metrics.csv").read_text().splitlines()  # iteration 0
    metrics = dict(zip(header.split(","), row.split(",")))
    judged = float(metrics["reward_unifiedreward"]) * 20  # the mean of 4 scores k / 5: a whole number of 20ths
    assert 4 <= judged <= 20 and abs(judged - round(judged)) < 1e-9, metrics
    # a judge that fails is a RewardServerError (below), on which lean train keeps the rollout (test_reward_server)


@pytest.mark.timeout(200)
def test_lean_train_trains_against_a_tiny_local_pairwise_judge(vlm_server, tmp_path, monkeypatch):
    """Pref-GRPO's win rate (reward.win_rate.judge=unifiedreward_think) asking the served judge one request per pair,
    its verdicts constrained to UnifiedReward-Think's two answers (tests/test_prefgrpo.py: the rest of Pref-GRPO)."""
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    judge = "reward.judges.think"
    sets = ["reward.weights={win_rate: 1.0}", "reward.win_rate.judge=unifiedreward_think"]
    sets += ["reward.win_rate.judge_endpoint=think", f"{judge}.base_url={vlm_server}", f"{judge}.model=judge"]
    sets += [
        f"{judge}.guided_choice={json.dumps(PAIRWISE_VERDICTS)}",
        f"{judge}.max_tokens=64",
        f"{judge}.api_key_env={TOKEN_ENV}",
    ]
    sets += ["train.group_size=3", "algorithm.adv_std=unbiased", "algorithm.adv_eps=1e-8"]
    cfg = tiny(*sets)
    judged = PairwiseWinRate(cfg.reward, lambda name: None).judge.prefer(torch.rand(3, 3, 32, 32), group_pairs(3), "a")
    assert judged.dtype == torch.float64 and set(judged.tolist()) <= {0.0, 1.0}  # each pair a verdict, no tie
    train(cfg, out=str(tmp_path))
    header, row = (tmp_path / "metrics.csv").read_text().splitlines()  # iteration 0
    metrics = dict(zip(header.split(","), row.split(",")))
    # a group's 3 win rates are wins / 2 and its 3 pairs give 3 wins: the group's mean is 1/2, so the batch's is too
    # (the verdicts above are each pair's, not ties)
    assert float(metrics["reward_win_rate"]) == pytest.approx(0.5, abs=1e-12), metrics


def completion(text: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "answer,delay_s,problem,requests",
    [
        ((200, b"<html>proxy error</html>"), 0, "the answer is not a chat completion", 3),
        ((200, completion("A fine image.")), 0, "no score in the answer", 3),
        ((200, completion("Final Score: 9")), 0, "no score in the answer", 3),  # outside [1, 5]
        ((503, b"overloaded"), 0, "HTTP 503 overloaded", 3),
        ((200, completion("Final Score: 4")), 1.0, "timed out", 3),
        ((401, b"bad key"), 0, "HTTP 401 bad key", 1),  # not retried
    ],
)
def test_a_bad_judge_is_an_error_naming_the_endpoint_after_the_retries(junk_server, answer, delay_s, problem, requests):  # noqa: F811
    junk_server.answer, junk_server.delay_s = answer, delay_s
    url = f"http://127.0.0.1:{junk_server.server_address[1]}"
    reward = judge(url, timeout_s=0.3, retries=2, backoff_s=0.01, concurrency=1)
    with pytest.raises(
        RewardServerError, match=rf"^reward unifiedreward: server {url}/v1/chat/completions: .*{problem}"
    ):
        reward(torch.rand(1, 3, 8, 8), ["a"])
    assert junk_server.requests == requests


def test_a_judge_that_is_down_is_retried():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RewardServerError, match=rf"server {url}/v1/chat/completions: .*Connection.*after 2 attempt"):
        judge(url, retries=1, backoff_s=0.01)(torch.rand(2, 3, 8, 8), ["a", "b"])


def test_flowgrpo_scoring_and_its_unparseable_zero(junk_server):  # noqa: F811
    unified, qwenvl = JUDGE_TEMPLATES["unifiedreward"], JUDGE_TEMPLATES["qwenvl"]
    assert parse_score("...\nFinal Score: 3.5", unified) == 3.5 and parse_score("<Score>4</Score>", qwenvl) == 4
    assert unified.text.endswith("Text Caption: [{prompt}]") and "{prompt}" not in qwenvl.text
    with pytest.raises(ValueError, match="outside"):
        parse_score("<Score>7</Score>", qwenvl)
    junk_server.answer = (200, completion("I cannot judge this."))
    url = f"http://127.0.0.1:{junk_server.server_address[1]}/v1"  # the OpenAI client's spelling of the base URL
    assert judge(url, unparseable_score=0.0)(torch.rand(2, 3, 8, 8), ["a", "b"]).tolist() == [0.0, 0.0]
    assert junk_server.requests == 2  # not retried
    junk_server.answer = (200, completion("Final Score: 2"))
    assert judge(url, normalise="range")(torch.rand(1, 3, 8, 8), ["a"]).tolist() == [0.25]


def test_judges_are_checked(capsys):
    base = ["reward.weights={unifiedreward: 1.0}", "reward.judges.unifiedreward.base_url=http://h:1"]
    with pytest.raises(ConfigError, match="reward.judges.unifiedreward.template='unified': must be one of"):
        tiny(*base, "reward.judges.unifiedreward.template=unified")
    with pytest.raises(ConfigError, match="reward.judges.unifiedreward.base_url='h:1': must be an http"):
        tiny(*base, "reward.judges.unifiedreward.base_url=h:1")
    with pytest.raises(ConfigError, match="reward.judges.unifiedreward.normalise='mean': must be one of"):
        tiny(*base, "reward.judges.unifiedreward.normalise=mean")
    assert main(["reward", "serve", "--vlm", "/nowhere", "--port", str(free_port())]) == 2
    assert "lean: config error: --vlm='/nowhere': no config.json" in capsys.readouterr().err
