"""``lean reward serve --vlm FOLDER``: a local transformers VLM folder (Qwen2-VL, Qwen2.5-VL, ...) under the OpenAI chat
API, offline, so that a VLM judge (``lean.rewards.vlm_judge``) runs without vLLM or SGLang.

    GET  /health               -> {"status": "ok", "model": name}               (no token needed)
    GET  /v1/models            -> {"object": "list", "data": [{"id": name, "object": "model", ...}]}
    POST /v1/chat/completions  {"model", "messages", "temperature", "max_tokens",
                                "structured_outputs": {"choice": [...]}? or "guided_choice": [...]?}
                               -> {"object": "chat.completion", "choices": [{"message": {"role": "assistant",
                                   "content": text}, "finish_reason": "stop" | "length"}], "usage": {...}}

Images come as ``image_url`` parts holding data URLs (``data:image/png;base64,...``; a remote URL is refused: the
server is offline). The folder loads with ``AutoModelForImageTextToText`` and ``AutoProcessor``; where the latter
needs torchvision for the video processor and it is absent, the processor is assembled from the folder's tokenizer and
image processor (``lean.models.processors``). The prompt is the folder's chat template with the generation prompt.

``structured_outputs.choice`` (vLLM >= 0.12) or ``guided_choice`` (older vLLM): the answer is one of the listed
strings. Each is tokenised alone; at step k the logits of every token that does not continue a listed string whose
first k tokens were generated are masked (a string generated in full allows only end-of-sequence), so greedy decoding
(temperature 0) picks the most likely allowed token at each step, as vLLM's guided decoding does. Requests run one at
a time (a lock).
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations as objects (see server.py).

import base64
import io
import json
import os
import threading
import time
from pathlib import Path

import torch
from PIL import Image

from lean.models.processors import load_processor
from lean.models.spec import Processor
from lean.rewards.server import check_token, run_app


def folder_problem(folder: Path) -> str | None:
    """What keeps ``folder`` from loading as a VLM (one line), or None."""
    if not (folder / "config.json").is_file():
        return "no config.json: need a transformers VLM folder (save_pretrained of the model and its processor)"
    if not (folder / "preprocessor_config.json").is_file():
        return "no preprocessor_config.json: the processor's image part is missing"
    return None


def load_vlm_processor(folder: Path):
    """``AutoProcessor`` of ``folder``, or (its video processor needing torchvision) the processor from its parts."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder)
    except ImportError:  # transformers' video processors of Qwen2-VL and kin are torchvision's
        image = json.loads((folder / "preprocessor_config.json").read_text())
        image_class = image["image_processor_type"].removesuffix("Fast")
        processor_class = image.get("processor_class") or image_class.replace("ImageProcessor", "Processor")
        return load_processor(Processor(processor_class, image_class, {}), folder)


class LocalVLM:
    """A VLM folder loaded once onto ``device`` in its saved dtype (config.json's), served as model ``name``:
    :meth:`complete` answers one chat request."""

    def __init__(self, folder: str | Path, device: torch.device | str, name: str):
        from transformers import AutoModelForImageTextToText

        folder, self.name = Path(folder), name
        self.processor = load_vlm_processor(folder)
        self.tokenizer = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(folder).to(device).eval()
        self.device = torch.device(device)
        self.lock = threading.Lock()

    def prompt(self, messages: list[dict]) -> str:
        """The chat template's text of HF-style ``messages``, with the generation prompt."""
        owner = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def complete(self, body: dict) -> dict:
        """The chat completion of a request body (``ValueError``: a request this server cannot answer)."""
        messages, images = chat_messages(body.get("messages"))
        max_tokens, temperature, choices = generation_options(body)
        text = self.prompt(messages)
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt").to(self.device)
        n_prompt = inputs["input_ids"].shape[1]
        allowed = None if choices is None else self.allowed_tokens(choices, n_prompt)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with self.lock, torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, prefix_allowed_tokens_fn=allowed, **sampling)
        new = out[0, n_prompt:].tolist()
        finish = "stop" if new and new[-1] in self.end_ids() else "length"
        answer = self.tokenizer.decode(new, skip_special_tokens=True)
        return completion(self.name, answer, finish, n_prompt, len(new))

    def end_ids(self) -> set[int]:
        """The ids that end generation: the generation config's and the tokenizer's end-of-sequence."""
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        return ids | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())

    def allowed_tokens(self, choices: list[str], n_prompt: int):
        """``prefix_allowed_tokens_fn`` restricting the answer to one of ``choices`` (see the module docstring)."""
        sequences = [self.tokenizer(c, add_special_tokens=False).input_ids for c in choices]
        end = sorted(self.end_ids())

        def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
            done = ids[n_prompt:].tolist()
            k = len(done)
            following = {s[k] for s in sequences if len(s) > k and s[:k] == done}
            return sorted(following) + (end if any(s == done for s in sequences) else []) or end

        return allowed


def chat_messages(messages) -> tuple[list[dict], list[Image.Image]]:
    """OpenAI chat messages -> (the chat template's messages, the images in order); ``ValueError`` naming the fault."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: need a non-empty list of {role, content}")
    converted, images = [], []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("messages: each needs a role and a content")
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ValueError("messages: a content is a string or a list of parts")
        converted.append({"role": m["role"], "content": [_part(p, images) for p in parts]})
    return converted, images


def _part(part, images: list[Image.Image]) -> dict:
    """One content part in the chat template's form; an image part's picture is appended to ``images``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        url = (part.get("image_url") or {}).get("url", "") if isinstance(part.get("image_url"), dict) else ""
        images.append(decode_data_url(url))
        return {"type": "image"}
    raise ValueError(f"messages: unsupported content part {str(part)[:60]} (text and image_url are)")


def decode_data_url(url: str) -> Image.Image:
    """``data:image/...;base64,...`` -> an RGB image; ``ValueError`` for anything else (no downloads)."""
    if not url.startswith("data:") or ";base64," not in url:
        raise ValueError(f"image_url: need a base64 data URL (this server is offline), got {url[:40]!r}")
    try:
        with Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1], validate=True))) as image:
            return image.convert("RGB")
    except Exception as err:  # binascii.Error, PIL's UnidentifiedImageError
        raise ValueError(f"image_url: not a base64 image ({type(err).__name__})") from None


def generation_options(body: dict) -> tuple[int, float, list[str] | None]:
    """(max_tokens, temperature, the allowed answers or None) of a request (unset: 256 tokens, OpenAI's temperature
    1); ``ValueError`` for bad values."""
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 256
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    structured = body.get("structured_outputs")
    choices = structured.get("choice") if isinstance(structured, dict) else body.get("guided_choice")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: need a positive integer, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature: need a number >= 0, got {temperature!r}")
    if choices is not None and (
        not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices)
    ):
        raise ValueError("guided_choice / structured_outputs.choice: need a non-empty list of strings")
    return max_tokens, float(temperature), choices


def completion(model: str, text: str, finish: str, n_prompt: int, n_completion: int) -> dict:
    """An OpenAI chat completion object holding one answer."""
    return {
        "id": f"chatcmpl-{time.time_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
        },
    }


def create_vlm_app(vlm: LocalVLM, token: str | None = None):
    """The FastAPI app serving ``vlm`` (as model ``vlm.name``); ``token``: the bearer token every completion needs."""
    from fastapi import FastAPI, HTTPException, Request
    from starlette.concurrency import run_in_threadpool

    app, name = FastAPI(title=f"lean VLM {vlm.name}"), vlm.name

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": name}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "lean"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        check_token(request, token)
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("need a JSON object")
            return await run_in_threadpool(vlm.complete, body)
        except ValueError as err:  # json.JSONDecodeError included
            raise HTTPException(400, str(err)) from None

    return app


def serve_vlm(folder: str, name: str, device: str, host: str, port: int, token_env: str | None = None) -> None:
    """Serve the VLM in ``folder`` as model ``name`` until interrupted; the token is read from ``token_env``."""
    token = os.environ[token_env] if token_env is not None else None
    run_app(create_vlm_app(LocalVLM(folder, device, name), token), f"VLM {name} (OpenAI chat API)", host, port, token)
