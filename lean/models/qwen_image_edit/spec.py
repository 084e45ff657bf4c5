"""Qwen-Image-Edit's :class:`~lean.models.spec.FamilySpec`: Qwen-Image's components, scheduler, LoRA targets and CFG,
plus the processor folder, the vision markers of a random build's tokenizer and the reference resolution."""

from __future__ import annotations

from lean.models.qwen_image.spec import SPEC as QWEN_IMAGE
from lean.models.qwen_image_edit.model import QwenImageEdit
from lean.models.qwen_image_edit.sizes import IMAGE_PROCESSOR, SIZES
from lean.models.spec import FamilySpec, Processor

SPEC = FamilySpec(
    display_name="Qwen-Image-Edit",
    pipeline="QwenImageEditPipeline",
    components=QWEN_IMAGE.components,  # Qwen/Qwen-Image-Edit's model_index.json: Qwen-Image's, plus the processor
    tokenizers=QWEN_IMAGE.tokenizers,
    t5_tokenizer=QWEN_IMAGE.t5_tokenizer,
    vae=QWEN_IMAGE.vae,
    packed_latents=True,
    # Qwen/Qwen-Image-Edit's scheduler_config.json is Qwen-Image's (written from memory): e^mu dynamic shift from the
    # noisy tokens (qwenimage_edit_pipeline_with_logprob.py:115-122 at 9745241) and shift_terminal 0.02
    scheduler=QWEN_IMAGE.scheduler,
    sizes=SIZES,
    # FlowGRPO's targets, identical to Qwen-Image's (scripts/train_qwenimage_edit.py:416-433 at 9745241)
    lora_attention=QWEN_IMAGE.lora_attention,
    lora_ffn=QWEN_IMAGE.lora_ffn,
    runtime=QwenImageEdit,
    block_lists=QWEN_IMAGE.block_lists,
    sequence_parallel=False,  # as Qwen-Image: the masked joint attention is not in lean's Ulysses processors
    reference_images=True,
    cfg_renorm=True,  # QwenImageEditPipeline's true CFG with the per-token norm rescale (FlowGRPO's too, :199-203)
    true_cfg=True,
    # Qwen2VLProcessor (Qwen2Tokenizer + Qwen2VLImageProcessor), read by encode_text
    processors={"processor": Processor("Qwen2VLProcessor", "Qwen2VLImageProcessor", IMAGE_PROCESSOR)},
    # the chat markers of the template and the vision markers the processor and Qwen2.5-VL find by id
    special_tokens=(
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    special_token_ids={
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
    },
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
