"""The geometry of a family that denoises the VAE's own latent grid ``x [B, C, h, w]`` and patchifies it inside its
transformer (SD3, Z-Image): the policy's noise and latent are the same tensor, image tokens (h / p) (w / p) for p x p
patches, and the VAE latent normalised as z = (z_vae - shift) * scale."""

from __future__ import annotations

from torch import Tensor


def vae_scale(vae_config) -> int:
    """The pipelines' ``vae_scale_factor``: pixels per latent cell, 2 ** (number of VAE down blocks - 1)."""
    return 2 ** (len(vae_config.block_out_channels) - 1)


class LatentGrid:
    """Mixin: a family's runtime sets its grid with :meth:`set_grid`, after its own resolution check."""

    def set_grid(self, vae_config, resolution: int, patch: int) -> None:
        self.h = self.w = resolution // vae_scale(vae_config)
        self.patch = patch
        self.channels = vae_config.latent_channels
        self.scaling, self.shift = vae_config.scaling_factor, vae_config.shift_factor

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.channels, self.h, self.w)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self.noise_shape

    @property
    def image_seq_len(self) -> int:
        """Image tokens (the pipelines' ``image_seq_len``, what a dynamically shifting scheduler reads)."""
        return (self.h // self.patch) * (self.w // self.patch)

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        return noise

    def latents_from_vae(self, z: Tensor) -> Tensor:
        return (z - self.shift) * self.scaling
