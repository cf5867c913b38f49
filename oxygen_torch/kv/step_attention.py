"""Attention and dense read-back of a PagedKVCore's step: the paged kernels, or for a fresh
prefill (no sequence held a token before the step) the forward's own K/V through SDPA, chosen
per call by kv/fresh.py."""

from __future__ import annotations

import torch

from . import fresh as _fresh
from .attention import gather_blocks, paged_attention
from .plan import StepPlan


class AttendMixin:
    """Part of PagedKVCore (see core.py)."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        plan: StepPlan,
        *,
        scale: float | None,
        sliding_window: int | None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [B, Hq, q_len, D] -> attention output [B, q_len, Hq, D] (padding rows are 0).
        k, v: the step's new K/V [B, Hkv, q_len, D] as written (a fresh prefill may attend
        them directly; without them the step reads the cache)."""
        self._check_window(layer, sliding_window)
        st = self.pool.storage
        batch, hq, q_len, d = q.shape
        if self.debug:
            st.check_blocks(self.table)
        scales = dict(k_scale=self.pool.k_scale(layer), v_scale=self.pool.v_scale(layer))
        if plan.cu_seqlens_q is None:
            out = paged_attention(
                q[:, :, 0],
                st.k[layer],
                st.v[layer],
                self.table,
                self.seq_lens,
                scale=scale,
                sliding_window=sliding_window,
                precision=self.precision,
                tiles=self.tiles,
                **scales,
            )  # [B, Hq, D]
            return out.unsqueeze(1)
        path, why = _fresh.choose(
            self.fresh_prefill, fresh=plan.fresh and k is not None, device=q.device,
            dtype=q.dtype, head_dim=d, columns=q_len, padded=plan.q_index is not None,
            window=sliding_window, kv_dtype=self.kv_dtype, precision=self.precision,
        )  # fmt: skip
        _fresh.count(path, why, layer)
        if path == "dense":
            return _fresh.dense_attention(
                q, k, v, real=plan.real, scale=scale, sliding_window=sliding_window,
                precision=self.precision, masks=plan.masks,
            )  # fmt: skip
        qr = q.transpose(1, 2).reshape(batch * q_len, hq, d)
        if plan.q_index is not None:
            qr = qr.index_select(0, plan.q_index)
        out = paged_attention(
            qr,
            st.k[layer],
            st.v[layer],
            self.table,
            self.seq_lens,
            plan.cu_seqlens_q,
            scale=scale,
            sliding_window=sliding_window,
            precision=self.precision,
            tiles=self.tiles,
            **scales,
        )
        if plan.q_index is not None:
            full = out.new_zeros(batch * q_len, hq, d)
            out = full.index_copy_(0, plan.q_index, out)
        return out.view(batch, q_len, hq, d)

    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K, V as [B, Hkv, length, D] (only when no padding was skipped)."""
        if self._pad_frontier or any(n != self.length for n in self.seqs.lens):
            raise NotImplementedError(
                "PagedKVCache: this cache skipped padding (oxygen attention); it cannot be read "
                "back densely by another attention implementation"
            )
        if any(self.seqs.dropped) or any(self.seqs.narrowed):
            raise NotImplementedError(
                "PagedKVCache: this cache gave back (or narrowed) the blocks behind its sliding "
                "window "
                "(oxygen attention); it cannot be read back densely by another attention "
                "implementation"
            )
        st, n = self.pool.storage, self.length
        nblk = -(-n // self.block_tokens)
        idx = self.table[:, :nblk].to(torch.int64)  # [B, nblk]: only allocated blocks
        pool, dtype = self.pool, self.model_dtype
        k = gather_blocks(st.k[layer], pool.k_scale(layer), idx, n, dtype)
        return k, gather_blocks(st.v[layer], pool.v_scale(layer), idx, n, dtype)
