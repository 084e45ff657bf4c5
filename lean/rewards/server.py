"""``lean reward serve``: one registered reward over HTTP (FastAPI + uvicorn), for reward stacks that run in their own
environment or on their own machine. The protocol and the client are in ``lean.rewards.remote``; ``--vlm FOLDER``
serves a VLM under the OpenAI chat API instead (``lean.rewards.vlm_server``).

    GET  /health  -> {"status": "ok", "reward": name}                         (no token needed)
    POST /score   {"prompts": [...], "images": [base64 PNG | [PNG per frame]]} -> {"scores": [...]}

A request that is not of that shape is answered 400 with the reason; a wrong or missing bearer token (when the server
holds one) 401. Requests are scored one at a time (a lock), so a model on a GPU never sees two batches at once.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations (fastapi's Request, imported in
# create_app only, since fastapi is optional) as objects.

import hmac
import os
import threading

import torch

from lean.rewards.base import RewardFn
from lean.rewards.remote import parse_request, scores_json


def create_app(name: str, reward: RewardFn, token: str | None = None):
    """The FastAPI app serving ``reward`` under ``name``; ``token``: the bearer token every /score needs."""
    from fastapi import FastAPI, HTTPException, Request  # local: optional, and slow to import
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title=f"lean reward {name}")
    lock = threading.Lock()

    def score(images: torch.Tensor, prompts: list) -> list:
        with lock:
            return scores_json(reward(images, prompts))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "reward": name}

    @app.post("/score")
    async def score_request(request: Request) -> dict:
        check_token(request, token)
        try:
            prompts, images = parse_request(await request.json())
        except ValueError as err:  # json.JSONDecodeError included
            raise HTTPException(400, str(err)) from None
        return {"scores": await run_in_threadpool(score, images, prompts)}

    return app


def check_token(request, token: str | None) -> None:
    """HTTP 401 unless ``request`` carries ``Authorization: Bearer <token>`` (when the server holds a token)."""
    from fastapi import HTTPException

    if token is not None and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
        raise HTTPException(401, "missing or wrong bearer token")


def serve(name: str, reward: RewardFn, host: str, port: int, token_env: str | None = None) -> None:
    """Serve ``reward`` until interrupted; the token is read from the environment variable ``token_env``."""
    token = os.environ[token_env] if token_env is not None else None
    run_app(create_app(name, reward, token), name, host, port, token)


def run_app(app, what: str, host: str, port: int, token: str | None) -> None:
    """Run ``app`` under uvicorn until interrupted, after one line saying what is served where."""
    import uvicorn

    print(f"lean reward serve: {what} on http://{host}:{port}" + (" (bearer token)" if token else ""), flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
