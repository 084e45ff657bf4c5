"""The 16-channel ``AutoencoderKL`` layout that FLUX and SD3 share, at any width."""


def kl_vae_config(
    channels: tuple[int, ...], layers_per_block: int, groups: int, *, scaling_factor: float, shift_factor: float
) -> dict:
    """AutoencoderKL config: len(channels) levels (2^(len-1)x downsampling), 16 latent channels, no quant convs."""
    return dict(
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=layers_per_block,
        norm_num_groups=groups,
        latent_channels=16,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )
