"""Model families as specs: every registered ``FamilySpec`` is complete and typed, its runtime implements the whole
``FamilyRuntime`` protocol, nothing outside ``lean/models/`` probes a family with ``getattr``/``hasattr``, and a policy
with two denoisers (Wan2.2-A14B's high- and low-noise experts) runs each on its side of the boundary sigma."""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import inspect
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch

from lean.models import FAMILIES, build_policy, family_spec
from lean.models.options import ModelConfig
from lean.models.spec import Component, FamilyRuntime, FamilySpec, Size, VaeConvention

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red cube", "a blue ball"]


def conforms(value, tp) -> bool:
    """``value`` is of the annotated type ``tp`` (the forms FamilySpec uses: classes, unions, Literal, tuple[X, ...],
    Mapping / dict[K, V], Callable)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        return isinstance(value, tuple) and all(conforms(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, collections.abc.Mapping) and all(
            conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items()
        )
    if origin is collections.abc.Callable:
        return callable(value)
    return isinstance(value, tp)


def typed(obj) -> list[str]:
    """The fields of dataclass ``obj`` (recursively) whose value is not of their annotated type."""
    hints = typing.get_type_hints(type(obj))
    wrong = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not conforms(value, hints[f.name]):
            wrong.append(f"{type(obj).__name__}.{f.name}={value!r}")
        values = value.values() if isinstance(value, collections.abc.Mapping) else [value]
        wrong += [w for v in values if dataclasses.is_dataclass(v) for w in typed(v)]
    return wrong


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_spec_is_complete_and_typed(name):
    spec = family_spec(name)
    assert isinstance(spec, FamilySpec) and dataclasses.is_dataclass(spec)
    assert typed(spec) == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.pipeline = "x"
    assert all(isinstance(c, Component) for c in spec.components.values())
    assert isinstance(spec.vae, VaeConvention) and all(isinstance(s, Size) for s in spec.sizes.values())
    assert {"tiny", "small", "full"} <= set(spec.sizes)
    for size in spec.sizes:  # every component has a config at every size
        assert all(isinstance(spec.size_config(size, c), dict) for c in spec.components)
    assert spec.video == (spec.vae.temporal_compression is not None)
    assert spec.t5_tokenizer in spec.tokenizers.values()
    assert spec.lora_targets(False) in spec.lora_targets(True)
    assert re.compile(spec.lora_targets(True))
    assert spec.scheduler["_class_name"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_runtime_implements_the_family_protocol(name):
    runtime = family_spec(name).runtime
    members = {n for n in vars(FamilyRuntime) if not n.startswith("_")} | set(FamilyRuntime.__annotations__)
    assert {"shard_sequence", "splits_text", "latents_from_vae", "forward", "decode"} <= members
    assert [m for m in sorted(members) if not hasattr(runtime, m)] == []


@pytest.mark.parametrize("name", list(FAMILIES))
def test_spec_capabilities_match_the_classes(name):
    import diffusers

    spec = family_spec(name)
    cls = getattr(diffusers, spec.components[spec.denoiser_folders[0]].model_class)
    assert spec.keeps_float32 == bool(getattr(cls, "_keep_in_fp32_modules", None))
    assert spec.guidance_embed == spec.size_config("full", "transformer").get("guidance_embeds", False)
    assert spec.video == ("num_frames" in inspect.signature(getattr(diffusers, spec.pipeline).__call__).parameters)
    if not spec.sequence_parallel:
        with pytest.raises(NotImplementedError):
            spec.runtime.shard_sequence(None, None, None)
    # an editing family's pipeline takes the reference image; a family without references refuses to encode one
    if spec.reference_images:
        assert "image" in inspect.signature(getattr(diffusers, spec.pipeline).__call__).parameters
    else:
        with pytest.raises(NotImplementedError):
            spec.runtime.encode_reference(None, None, None)


def test_importing_the_families_imports_no_diffusers():
    code = "import sys, lean.models; assert not {'diffusers', 'transformers', 'peft'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------- no capability probes outside lean/models

PROBED = re.compile(r"\b(spec|family|families|FAMILIES|runtime|ARCH|family_spec|family_module)\b")
GONE = {"family_module", "FRAME_STEP", "GUIDANCE_EMBED", "KEEPS_FLOAT32", "ARCH", "reference_transformer"}


def is_probe(node: ast.AST) -> bool:
    """A ``getattr(obj, ...)`` or ``hasattr(obj, ...)`` call."""
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and bool(node.args)


def outside_models() -> list[Path]:
    return [p for p in (ROOT / "lean").rglob("*.py") if (ROOT / "lean" / "models") not in p.parents]


def test_no_getattr_or_hasattr_on_a_family_outside_lean_models():
    probes = []
    for path in outside_models():
        for node in ast.walk(ast.parse(path.read_text())):
            if is_probe(node) and PROBED.search(ast.unparse(node.args[0])):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert probes == []


def test_the_module_constants_are_gone_and_sequence_parallel_hooks_stay_in_lean_models():
    found = []
    for path in (ROOT / "lean").rglob("*.py"):
        inside = (ROOT / "lean" / "models") in path.parents
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in GONE or (name == "shard_sequence" and not inside):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert found == []


def test_the_probe_finder_finds_probes():
    tree = ast.parse('x = getattr(family_spec(f), "FRAME_STEP", None)\ny = hasattr(policy.runtime, "scaling")')
    calls = [n for n in ast.walk(tree) if is_probe(n)]
    assert [bool(PROBED.search(ast.unparse(c.args[0]))) for c in calls] == [True, True]


# ---------------------------------------------------------------- several denoisers

BOUNDARY = 0.5


@pytest.fixture
def experts(monkeypatch):
    """A two-expert Wan (Wan2.2-A14B's layout at the tiny size): ``transformer`` (high noise) and ``transformer_2``
    (low noise), two WanTransformer3DModels drawn from their own seeds, split at sigma 0.5."""
    wan = family_spec("wan")
    spec = dataclasses.replace(
        wan,
        components={**wan.components, "transformer_2": wan.components["transformer"]},
        denoiser_folders=("transformer", "transformer_2"),
        boundary=BOUNDARY,
    )
    monkeypatch.setitem(FAMILIES, "experts", spec)
    return "experts"


def _inputs(policy, sigmas):
    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(len(sigmas))])
    return x, torch.tensor(sigmas, dtype=policy.dtype), policy.encode_prompts(PROMPTS[: len(sigmas)])


def test_two_experts_each_run_on_their_side_of_the_boundary(experts, tmp_path):
    policy = build_policy(ModelConfig(family=experts, gradient_checkpointing=True), PROMPTS)
    high, low = policy.denoisers
    assert len(policy.denoisers) == 2 and policy.denoiser_folders == ("transformer", "transformer_2")
    assert not torch.equal(next(high.parameters()), next(low.parameters()))  # two random draws
    assert policy.denoiser_for(0.9) is high and policy.denoiser_for(BOUNDARY) is high
    assert policy.denoiser_for(0.2) is low
    with pytest.raises(ValueError, match="2 denoisers"):
        policy.transformer  # noqa: B018

    # gradient checkpointing and LoRA on both; the trainable parameters cover both, named by folder
    assert high.get_base_model().is_gradient_checkpointing and low.get_base_model().is_gradient_checkpointing
    names = [n for n, _ in policy.trainable_parameters()]
    assert all(".lora_" in n for n in names)
    for folder, net in zip(policy.denoiser_folders, policy.denoisers, strict=True):
        own = [n for n in names if n.startswith(f"{folder}.base_model.")]
        assert len(own) == sum(p.requires_grad for p in net.parameters()) == len(names) // 2

    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    x, sigma, emb = _inputs(policy, [0.9, 0.2])
    with torch.no_grad():
        v = policy.velocity(x, sigma, emb)
        for b, net in enumerate((high, low)):  # each sample ran its own expert
            alone = policy.runtime.forward(net, x[b : b + 1], sigma[b : b + 1], emb.index(b), None)
            other = policy.runtime.forward((low, high)[b], x[b : b + 1], sigma[b : b + 1], emb.index(b), None)
            torch.testing.assert_close(v[b : b + 1], alone)
            assert (v[b : b + 1] - other).abs().max() > 1e-4
        with policy.reference():  # both adapters off
            ref = policy.velocity(x, sigma, emb)
        assert (ref - v).abs().max() > 1e-4
        for b, net in enumerate((high, low)):
            with net.disable_adapter():
                torch.testing.assert_close(
                    ref[b : b + 1], policy.runtime.forward(net, x[b : b + 1], sigma[b : b + 1], emb.index(b), None)
                )

    policy.velocity(x, sigma, emb).square().mean().backward()
    grads = {n.split(".")[0]: p.grad for n, p in policy.trainable_parameters() if ".lora_B." in n}
    assert set(grads) == {"transformer", "transformer_2"} and all(g.abs().sum() > 0 for g in grads.values())

    policy.save_pretrained(tmp_path)  # both folders and WanPipeline's boundary_ratio
    loaded = build_policy(ModelConfig(family=experts, pretrained=str(tmp_path)), PROMPTS)
    assert (tmp_path / "transformer_2" / "config.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.velocity(x, sigma, emb),
            policy.velocity(x, sigma, emb),
            rtol=0,
            atol=0,
        )


def test_two_experts_full_finetune_keeps_a_reference_of_each(experts):
    policy = build_policy(ModelConfig(family=experts, full_finetune=True), PROMPTS)
    assert len(policy.reference_denoisers) == 2 and len(policy.networks()) == 4
    total = sum(p.numel() for net in policy.denoisers for p in net.parameters())
    assert sum(p.numel() for _, p in policy.trainable_parameters()) == total
    x, sigma, emb = _inputs(policy, [0.9, 0.2])
    with torch.no_grad():
        v0 = policy.velocity(x, sigma, emb)
        policy.perturb_lora_(0.01, torch.Generator().manual_seed(0))
        with policy.reference():
            torch.testing.assert_close(policy.velocity(x, sigma, emb), v0)
