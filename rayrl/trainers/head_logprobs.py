"""Log-probs (and entropies) of target tokens through a frozen output head, a few rows at a time.

The plain way, ``log_softmax(h @ W.T).gather(target)``, holds the whole ``positions x vocabulary``
logits matrix in float32, keeps the log-softmax output for the backward pass, and makes two more
matrices that size there (the log-softmax's gradient, the logits' gradient): at the bench's 784 trained
positions and SmolLM2's 49,152-word vocabulary, 154 MB each. When the head's weight does not train (LoRA,
where the tied embedding is frozen; any no-grad pass), the gradient that reaches the hidden states needs
no logits matrix at all. For a row with probabilities ``p`` over the vocabulary and target ``t``:

- ``d logp_t / d h = W_t - p @ W = -(p - onehot_t) @ W``
- ``d H / d h = -(p * (z - E_p[z])) @ W`` (the entropy ``H = logsumexp(z) - E_p[z]``)

Both are vectors of the hidden size, known once the forward pass has ``p``, so :func:`frozen_head_logprobs`
computes them there, chunk by chunk, and keeps only them for the backward pass, which scales them by the
incoming gradients. The matmul that the plain backward runs (the logits' gradient times ``W``) runs in the
forward instead: the same work, nothing recomputed, and at most one chunk of logits alive at a time.
With the entropy, ``p @ W`` and ``(p * z) @ W`` are two matmuls where the plain backward has one.

A head whose weight trains (full weights) keeps the plain path: its weight gradient needs every row's
``p`` with the incoming gradient, so a chunked form would have to recompute the logits.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_BYTES = 32 << 20  # one chunk's float32 logits: enough rows for an efficient matmul, a bounded footprint


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's float32 logits stay within ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab))


class _FrozenHeadLogprobs(torch.autograd.Function):
    """Outputs the target's log-prob and the entropy per row; the gradient reaches ``hidden`` only."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, with_entropy: bool, compute_dtype: torch.dtype | None,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype or hidden.dtype
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = hidden.shape[0]
        grads = ctx.needs_input_grad[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        d_logp = torch.empty((n, hidden.shape[1]) if grads else (0,), dtype=torch.float32, device=hidden.device)
        d_ent = torch.empty((n, hidden.shape[1]) if grads and with_entropy else (0,), dtype=torch.float32,
                            device=hidden.device)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            z = torch.nn.functional.linear(hidden[start:end].to(dtype), w, b).float()
            t = targets[start:end].unsqueeze(-1)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            logp[start:end] = (z.gather(-1, t) - lse).squeeze(-1)
            p = torch.softmax(z, dim=-1)  # as accurate as the plain path's (exp(z - lse) is not: lse's rounding)
            if with_entropy:
                mean_z = (p * z).sum(-1, keepdim=True)
                entropy[start:end] = (lse - mean_z).squeeze(-1)
            if not grads:
                continue
            if with_entropy:  # -(p * (z - E_p[z])) @ W, before p becomes p - onehot below
                d_ent[start:end] = torch.mm((z.sub_(mean_z).mul_(p)).to(dtype), w).float().neg_()
            d_logp[start:end] = torch.mm(p.scatter_add_(-1, t, torch.full_like(t, -1, dtype=p.dtype)).to(dtype),
                                         w).float().neg_()
        ctx.save_for_backward(d_logp, d_ent)
        ctx.hidden_dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        d_logp, d_ent = ctx.saved_tensors
        grad = None
        if g_logp is not None:
            grad = g_logp.unsqueeze(-1) * d_logp
        if g_ent is not None and d_ent.numel():
            term = g_ent.unsqueeze(-1) * d_ent
            grad = term if grad is None else grad + term
        if grad is not None:
            grad = grad.to(ctx.hidden_dtype)
        return grad, None, None, None, None, None, None


def head_is_frozen(head: torch.nn.Module) -> bool:
    """Whether no parameter of the output head takes a gradient here (frozen, or no grad mode)."""
    return not torch.is_grad_enabled() or not any(p.requires_grad for p in head.parameters())


def frozen_head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *,
                         with_entropy: bool = False, compute_dtype: torch.dtype | None = None,
                         rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(head(hidden))`` at ``targets`` per row (float32), and with ``with_entropy`` each row's
    entropy, through a head whose parameters take no gradient (:func:`head_is_frozen`; ValueError
    otherwise). ``compute_dtype``: the dtype of the matmuls (autocast's), default ``hidden``'s; ``rows``:
    rows per chunk (default :func:`chunk_rows`)."""
    if not head_is_frozen(head):
        raise ValueError("frozen_head_logprobs: the output head's weight takes a gradient; use the plain path")
    weight, bias = head.weight, getattr(head, "bias", None)
    rows = rows or chunk_rows(weight.shape[0])
    logp, entropy = _FrozenHeadLogprobs.apply(hidden, weight.detach(), None if bias is None else bias.detach(),
                                              targets, with_entropy, compute_dtype, rows)
    return logp, (entropy if with_entropy else None)
