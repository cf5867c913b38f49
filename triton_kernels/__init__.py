"""Triton kernels: paged attention, KV append, tiling, precision. Installed as oxygen_torch.triton_kernels."""
