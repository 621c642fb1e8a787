"""A GPT-2 in PyTorch, the reference for ``peers.py``: the same maths as kdist's default
GPTBackbone (learned positions, pre-LayerNorm, tanh-GELU MLP, biases, tied embeddings,
causal ``scaled_dot_product_attention``), written the way nanoGPT writes it.

    >>> model = TorchGPT(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
    ...                  intermediate_dim=32, max_sequence_length=8)
    >>> model(torch.zeros((1, 8), dtype=torch.long)).shape
    torch.Size([1, 8, 64])
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, hidden_dim: int, num_heads: int, intermediate_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.attention_norm = nn.LayerNorm(hidden_dim, eps=1e-5)
        self.qkv = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.attention_output = nn.Linear(hidden_dim, hidden_dim)
        self.mlp_norm = nn.LayerNorm(hidden_dim, eps=1e-5)
        self.up = nn.Linear(hidden_dim, intermediate_dim)
        self.down = nn.Linear(intermediate_dim, hidden_dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(d, dim=2)  # 3 x (B, T, D)
        q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)
                   for z in (q, k, v))  # (B, N, T, H)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, N, T, H)
        x = x + self.attention_output(h.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x)), approximate="tanh"))


class TorchGPT(nn.Module):
    def __init__(self, vocabulary_size: int, num_layers: int, num_heads: int, hidden_dim: int,
                 intermediate_dim: int, max_sequence_length: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocabulary_size, hidden_dim)
        self.position_embedding = nn.Embedding(max_sequence_length, hidden_dim)
        self.blocks = nn.ModuleList(Block(hidden_dim, num_heads, intermediate_dim)
                                    for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(hidden_dim, eps=1e-5)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x) @ self.token_embedding.weight.T  # (B, T, V), tied


def train_step_fn(model: nn.Module, learning_rate: float = 1e-4, compile: bool = False):
    """``step(x, y) -> loss``: forward, cross-entropy, backward, AdamW with the same
    hyper-parameters as kdist.optim.adamw (betas 0.9/0.95, decay 0.1, clip 1.0)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1, eps=1e-8)

    def loss_fn(x, y):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    loss_fn = torch.compile(loss_fn) if compile else loss_fn

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    return step
