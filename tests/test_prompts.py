"""Prompt files (``train.prompts_file``): FlowGRPO's train.txt and GenEval metadata.jsonl, read verbatim by
``lean.workbench.data.read_prompts``; bad files are one ConfigError line before any model is built."""

import json

import pytest
from helpers import QUICK

from lean.config import ConfigError
from lean.config.prompts import read_prompts
from lean.configure import load_config

TXT = 'a cat, a dog, and a bird\n\n"quoted" text\n2021\n  padded prompt  \r\nyes\nnull\n- a list item?\n'
TXT_PROMPTS = ["a cat, a dog, and a bird", '"quoted" text', "2021", "padded prompt", "yes", "null", "- a list item?"]


def test_txt_is_one_prompt_per_line_verbatim(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(TXT)
    assert read_prompts(path) == TXT_PROMPTS
    cfg = load_config(None, [f"train.prompts_file={path}"])  # replaces train.prompts, the list every consumer reads
    assert cfg.train.prompts == TXT_PROMPTS and cfg.train.prompts_file == str(path)


def test_jsonl_reads_the_prompt_field(tmp_path):
    rows = [  # GenEval's train_metadata.jsonl lines
        {"tag": "counting", "include": [{"class": "cat", "count": 2}], "prompt": "a photo of two cats"},
        {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
        {"tag": "x", "prompt": '2021, "quoted"'},
    ]
    path = tmp_path / "train_metadata.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    assert read_prompts(path) == [r["prompt"] for r in rows]
    assert load_config(None, [f"train.prompts_file={path}"]).train.prompts == [r["prompt"] for r in rows]


@pytest.mark.parametrize(
    "name,text,message",
    [
        ("missing.txt", None, "no such file"),
        ("empty.txt", "", "holds no prompt"),
        ("blank.txt", "\n  \n\n", "holds no prompt"),
        ("empty.jsonl", "\n", "holds no prompt"),
        ("no_prompt.jsonl", '{"prompt": "a cat"}\n{"tag": "counting"}\n', 'line 2: needs a "prompt" string field'),
        ("number.jsonl", '{"prompt": 2021}\n', 'line 1: needs a "prompt" string field'),
        ("list.jsonl", '["a cat"]\n', 'line 1: needs a "prompt" string field'),
        ("broken.jsonl", '{"prompt": "a cat"\n', "line 1: not JSON"),
    ],
)
def test_bad_prompt_files_are_one_config_error(tmp_path, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"train.prompts_file={path}"])
    assert err.value.key == "train.prompts_file" and message in str(err.value) and "\n" not in str(err.value)


def test_a_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.prompts_file.*not a file"):
        load_config(None, [f"train.prompts_file={tmp_path}"])


@pytest.mark.timeout(180)
def test_cli_trains_a_preset_on_a_prompt_file(tmp_path, capsys):
    """`lean train --preset` refuses a missing prompt file in one config error before writing anything, and trains on
    a present one, recording its prompts and path. The README's quick run at 32 px, 2 samples per prompt and 4 steps:
    reading the prompts does not depend on them."""
    from lean.cli import main

    path = tmp_path / "train.txt"
    path.write_text(TXT)
    quick = [*QUICK, "model.resolution=32", "train.group_size=2", "sample.num_steps=4"]
    args = ["train", "--preset", "flowgrpo-sd3", *(a for kv in quick for a in ("--set", kv))]
    assert main([*args, "--set", f"train.prompts_file={tmp_path / 'nope.txt'}", "--out", str(tmp_path / "bad")]) == 2
    assert "config error: train.prompts_file=" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert main([*args, "--set", f"train.prompts_file={path}", "--out", str(tmp_path / "run")]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["prompts"] == TXT_PROMPTS and config["train"]["prompts_file"] == str(path)
