"""Qwen-Image's :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.qwen_image.model import QwenImage
from lean.models.qwen_image.sizes import SIZES
from lean.models.spec import MEAN_STD, Component, FamilySpec, VaeConvention

# FlowGRPO's Qwen-Image targets (yifan123/flow_grpo at 9745241, scripts/train_qwenimage.py:410-423: "attn.to_k", ...,
# "img_mlp.net.0.proj", ..., "txt_mlp.net.2", matched by peft as module-name suffixes) reach every dual-stream block's
# joint attention (image projections to_q/k/v/out, text projections add_q/k/v_proj, to_add_out) and both streams'
# MLPs; the regexes below select exactly those modules of QwenImageTransformer2DModel. The MLPs are model.lora_ffn.
_ATTN = r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_FFN = r"transformer_blocks\.\d+\.(img_mlp|txt_mlp)\.net\.(0\.proj|2)"

SPEC = FamilySpec(
    display_name="Qwen-Image",
    pipeline="QwenImagePipeline",
    components={  # Qwen/Qwen-Image's model_index.json (its scheduler aside)
        "transformer": Component("diffusers", "QwenImageTransformer2DModel"),
        "vae": Component("diffusers", "AutoencoderKLQwenImage"),
        # Qwen2.5-VL-7B-Instruct; the pipeline reads its language model's last hidden states
        "text_encoder": Component("transformers", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
    },
    tokenizers={"text_encoder": "tokenizer"},  # Qwen2Tokenizer in the published folder
    t5_tokenizer="tokenizer",  # the one text tokenizer: its length caps the pipeline's max_sequence_length
    vae=VaeConvention(MEAN_STD),  # (z - latents_mean_c) / latents_std_c; images: no temporal_compression
    packed_latents=True,
    # Qwen/Qwen-Image's scheduler/scheduler_config.json (written from memory): QwenImagePipeline shifts by e^mu, mu
    # linear in the image token count from 0.5 at 256 tokens to 0.9 at 8192 (lean.models.scheduler reads it; the
    # static shift is unused). shift_terminal 0.02 then stretches the shifted grid so that its last non-zero sigma is
    # 0.02 (FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal). FlowGRPO's rollout keeps that stretch (its
    # pipeline_with_logprob calls retrieve_timesteps(scheduler, sigmas=linspace(1, 1/n, n), mu=mu),
    # flow_grpo/diffusers_patch/qwenimage_pipeline_with_logprob.py:98-113 at 9745241), and so does lean: with
    # sample.shift and sample.shift_terminal unset both come from here (lean.models.scheduler.terminal_stretch).
    scheduler={
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "invert_sigmas": False,
        "max_image_seq_len": 8192,
        "max_shift": 0.9,
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "shift_terminal": 0.02,
        "stochastic_sampling": False,
        "time_shift_type": "exponential",
        "use_beta_sigmas": False,
        "use_dynamic_shifting": True,
        "use_exponential_sigmas": False,
        "use_karras_sigmas": False,
    },
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=QwenImage,
    block_lists=("transformer_blocks",),  # 60 dual-stream blocks
    # No sequence parallelism yet: the joint attention masks the padded text tokens of each row
    # (encoder_hidden_states_mask), which lean's Ulysses attention processors do not carry.
    sequence_parallel=False,
    cfg_renorm=True,  # QwenImagePipeline's true CFG: v <- v * |v_c| / |v| per token
    true_cfg=True,  # QwenImagePipeline(true_cfg_scale=..., negative_prompt=...); its guidance_scale is unused
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
