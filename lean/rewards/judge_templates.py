"""VLM judges' questions and options: the templates lean ships (a question, a score pattern and range, an image
size) and ``reward.judges.<name>``, read by the client ``lean.rewards.vlm_judge``.

The shipped templates are FlowGRPO's at ac4c86e (flow_grpo/rewards.py, flow_grpo/qwenvl.py): ``unifiedreward``
(UnifiedReward-7b-v1.5 through SGLang, ``unifiedreward_score_sglang``: its question :315, images resized to 512 x 512
:350, ``Final Score:\\s*([1-5](?:\\.\\d+)?)`` :300, divided by 5 :355) and ``qwenvl`` (Qwen2.5-VL-7B-Instruct's
aesthetic judge, ``QwenVLScorer``: its task text qwenvl.py:40-58, which ignores the prompt, ``<Score>(\\d+)</Score>``
:19, divided by 5 :21). FlowGRPO scores an answer without a match 0 (rewards.py:308-309, qwenvl.py:22-23); lean
retries it and then stops, unless ``unparseable_score`` says otherwise.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from lean.config.checks import ConfigError, check_choice, check_positive, choice
from lean.config.registry import Registry
from lean.rewards.http import RetryOptions


@dataclass(frozen=True)
class JudgeTemplate:
    """What a judge is asked (``text``, ``{prompt}`` the sample's prompt) and how its score is read: the first group
    of ``pattern``, a number in [low, high]; ``image_size``: the side images are resized to (None: as they are)."""

    text: str
    pattern: str
    low: float
    high: float
    image_size: int | None = None


_UNIFIEDREWARD = (  # flow_grpo/rewards.py:315 at ac4c86e, the f-string's {prompt} kept as the placeholder
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in "
    "the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from 1 "
    "to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
_QWENVL = """
Your role is to evaluate the aesthetic quality score of given images.
1. Bad: Extremely blurry, underexposed with significant noise, indiscernible
subjects, and chaotic composition.
2. Poor: Noticeable blur, poor lighting, washed-out colors, and awkward
composition with cut-off subjects.
3. Fair: In focus with adequate lighting, dull colors, decent composition but
lacks creativity.
4. Good: Sharp, good exposure, vibrant colors, thoughtful composition with
a clear focal point.
5. Excellent: Exceptional clarity, perfect exposure, rich colors, masterful
composition with emotional impact.

Please first provide a detailed analysis of the evaluation process, including the criteria for judging aesthetic \
quality, within the <Thought> tag. Then, give a final score from 1 to 5 within the <Score> tag.
<Thought>
[Analyze the evaluation process in detail here]
</Thought>
<Score>X</Score>
"""  # flow_grpo/qwenvl.py:40-58 at ac4c86e (its line 53 is one line; the backslash keeps it so)

JUDGE_TEMPLATES: Registry[JudgeTemplate] = Registry(
    "judge template",
    [
        ("unifiedreward", JudgeTemplate(_UNIFIEDREWARD, r"Final Score:\s*([1-5](?:\.\d+)?)", 1, 5, image_size=512)),
        ("qwenvl", JudgeTemplate(_QWENVL, r"<Score>(\d+)</Score>", 1, 5)),
    ],
)
_UNIFIEDREWARD_THINK = (  # Pref-GRPO fastvideo/rewards/templates.py:172-235 at 3e787f6, {prompt} its placeholder
    "You are an objective and precise evaluator for image quality comparison. I will provide "
    "you with a text caption and two images generated based on this caption. You must analyze "
    "the two images carefully and determine which image is better.\n"
    "\n"
    "        Evaluation procedure:\n"
    "\n"
    "        1. The caption for the generated images is: 「{prompt}」. You must evaluate the two "
    "images across these core dimensions:\n"
    "        - Semantic consistency (how closely the image content aligns with the caption)\n"
    "        - Aesthetics (composition, color usage, artistic expression)\n"
    "        - Authenticity (realism and attention to detail)\n"
    "\n"
    "        2. You are also encouraged to add up to two additional evaluation dimensions if "
    "they are relevant to the specific caption or images (e.g., creativity, spatial layout, "
    "fine-grained detail). If no extra dimensions are relevant, just keep the three core "
    "dimensions.\n"
    "\n"
    "        3. For each evaluation dimension:\n"
    "        - Provide a score between 1–10 for both Image 1 and Image 2\n"
    "        - Provide a short rationale for each score (2–5 short sentences)\n"
    "        - The evaluation must follow exactly this format with line breaks and "
    "indentation:\n"
    "            Dimension name: \n"
    "                Image 1 (x/10) - rationale; \n"
    "                Image 2 (y/10) - rationale\n"
    "\n"
    "        4. After evaluating all dimensions, calculate the total score for each image and "
    "show the calculation explicitly, following this exact format:\n"
    "            Total score:\n"
    "            Image 1: x+x+x=total\n"
    "            Image 2: y+y+y=total\n"
    "\n"
    "        5. Wrap all reasoning and scoring strictly within <think> and </think> tags.\n"
    "\n"
    "        6. After </think>, output the final judgment strictly inside <answer> and "
    "</answer> tags, containing only one of:\n"
    "        - Image 1 is better\n"
    "        - Image 2 is better\n"
    "\n"
    "        Constraints:\n"
    "        - You must strictly follow the line breaks, indentation, and formatting shown in "
    "the example below.\n"
    "        - Do not merge multiple dimensions into one line. Each dimension must follow the "
    "3-line block format shown below.\n"
    "        - Do not use Markdown formatting, bullet points, bold text, or headings.\n"
    "        - Do not output explanations outside <think> and <answer>.\n"
    "        - The <answer> tag must contain only the final string with no extra words.\n"
    "\n"
    "        Required output format:\n"
    "\n"
    "        <think>\n"
    "        1. Semantic consistency: \n"
    "            Image 1 (9/10) - ...; \n"
    "            Image 2 (7/10) - ...\n"
    "        2. Aesthetics: \n"
    "            Image 1 (8/10) - ...; \n"
    "            Image 2 (8/10) - ...\n"
    "        3. Authenticity: \n"
    "            Image 1 (8/10) - ...; \n"
    "            Image 2 (5/10) - ...\n"
    "        [Additional dimension if any]: \n"
    "            Image 1 (7/10) - ...; \n"
    "            Image 2 (8/10) - ...\n"
    "        [Additional dimension if any]: \n"
    "            Image 1 (6/10) - ...; \n"
    "            Image 2 (7/10) - ...\n"
    "        Total score:\n"
    "        Image 1: 9+8+8+7+6=38\n"
    "        Image 2: 7+8+5+8+7=35\n"
    "        </think>\n"
    "        <answer>Image 1 is better</answer>\n"
    "\n"
    "        Note: The example above is only to illustrate the exact format (line breaks, "
    "indentation, symbols, and style). Your actual evaluation must follow this format exactly, "
    "but be based on the given caption and images.\n"
    "        "
)


@dataclass(frozen=True)
class PairwiseTemplate:
    """A pairwise judge's question (``{prompt}``: the group's prompt; both images come before it, the pair's first as
    Image 1) and how its verdict is read: the first group of ``verdict`` (none: a tie) holding ``first`` (the first
    image is preferred), else ``second``, else a tie."""

    text: str
    verdict: str
    first: str
    second: str


PAIRWISE_TEMPLATES: Registry[PairwiseTemplate] = Registry(
    "pairwise judge template",
    [
        (  # Pref-GRPO at 3e787f6: unifiedreward_think.py:16-18 the answer tag, :42-52 and :100-101 the verdicts
            "unifiedreward_think",
            PairwiseTemplate(_UNIFIEDREWARD_THINK, r"<answer>(.*?)</answer>", "Image 1 is better", "Image 2 is better"),
        ),
    ],
)


def parse_verdict(text: str, template: PairwiseTemplate) -> float:
    """P(first preferred) of one answer: 1, 0, or 1/2 for a tie or an answer without a verdict (Pref-GRPO's half a
    win each)."""
    match = re.search(template.verdict, text, re.DOTALL)
    verdict = match.group(1).strip() if match else ""
    return 1.0 if template.first in verdict else 0.0 if template.second in verdict else 0.5


NORMALISATIONS = ("max", "range", "none")
# How a request carries the allowed answers: vLLM >= 0.12 reads only structured_outputs.choice (its guided_* fields were
# removed, vllm-project/vllm#29326, and are ignored silently); older vLLM reads guided_choice
CHOICE_FIELDS = ("structured_outputs", "guided_choice")


@dataclass
class VLMJudgeConfig(RetryOptions):
    """``reward.judges.<name>``: a VLM judge at an OpenAI-compatible chat endpoint (``lean.rewards.vlm_judge``)."""

    base_url: str = ""
    """The server, e.g. http://127.0.0.1:8000 (vLLM, SGLang, lean reward serve --vlm); requests go to
    <base_url>/v1/chat/completions (a base_url ending in /v1, the OpenAI client's spelling, is taken as it is)."""
    model: str = ""
    """The served model's name (vLLM's --served-model-name; GET <base_url>/v1/models lists them)."""
    api_key_env: str | None = None
    """An environment variable holding the API key, sent as a bearer token (None: no key)."""
    template: str = choice("judge template")
    """A name of JUDGE_TEMPLATES: the question, how the score is parsed, its range and the image size."""
    prompt: str | None = None
    """Your own question instead of the template's ({prompt}: the sample's prompt); the template still parses."""
    temperature: float = 0.0
    max_tokens: int = 512
    concurrency: int = 8
    """Requests in flight at once."""
    guided_choice: list[str] | None = None
    """The answers the server may give (vLLM's constrained decoding, lean's server's too); None: not sent."""
    guided_choice_field: str = "structured_outputs"
    """How they are sent: structured_outputs ({"structured_outputs": {"choice": [...]}}, vLLM >= 0.12) or
    guided_choice ({"guided_choice": [...]}, older vLLM); lean reward serve --vlm reads either."""
    normalise: str = "max"
    """The reward from score s in [low, high]: max (s / high, FlowGRPO's), range ((s - low) / (high - low)), none."""
    image_size: int | None = None
    """The square side images are resized to before sending; None: the template's (UnifiedReward's 512, or none)."""
    unparseable_score: float | None = None
    """None: an answer without a score is retried, then an error; a number: the reward of such an answer, not retried
    (FlowGRPO's 0)."""

    def validate(self, key: str) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{key}.base_url", self.base_url, "must be an http:// or https:// URL")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ConfigError(f"{key}.api_key_env", self.api_key_env, "this environment variable is not set")
        check_choice(f"{key}.template", self.template, JUDGE_TEMPLATES)
        check_choice(f"{key}.normalise", self.normalise, NORMALISATIONS)
        check_choice(f"{key}.guided_choice_field", self.guided_choice_field, CHOICE_FIELDS)
        check_positive(f"{key}.max_tokens", self.max_tokens)
        check_positive(f"{key}.concurrency", self.concurrency)
        check_positive(f"{key}.temperature", self.temperature, strict=False)
        if self.image_size is not None:
            check_positive(f"{key}.image_size", self.image_size)
        if self.guided_choice is not None and not self.guided_choice:
            raise ConfigError(f"{key}.guided_choice", self.guided_choice, "list at least one answer, or null")
        self.validate_retries(key)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        return (base if base.endswith("/v1") else f"{base}/v1") + "/chat/completions"


def parse_score(text: str, template: JudgeTemplate) -> float:
    """The first group of ``template.pattern`` in ``text`` as a number in [low, high]; ValueError else."""
    match = re.search(template.pattern, text)
    score = _number(match.group(1)) if match else math.nan
    if not template.low <= score <= template.high:
        found = f"{score:g}, outside [{template.low:g}, {template.high:g}]" if match else "no match"
        raise ValueError(f"no score in the answer ({found} of {template.pattern!r}): {text[:80]!r}")
    return score


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan
