"""A small GPT: pre-norm blocks, causal scaled-dot-product attention, GELU MLP.

Shape legend for tensor names:
    B batch, T time (sequence position), D model width, H attention heads, K head width (D/H),
    V vocabulary.

    python -c "from diloco.model.gpt import GPT; from diloco.config import MODEL_PRESETS as P; \
print(GPT(P['nano']).num_params())"
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from diloco.config import ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_out = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp_in = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.mlp_out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        H = self.n_head
        q_BTD, k_BTD, v_BTD = self.qkv(self.ln_attn(x_BTD)).split(D, dim=2)
        q_BHTK, k_BHTK, v_BHTK = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD))
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        x_BTD = x_BTD + self.attn_out(y_BHTK.transpose(1, 2).reshape(B, T, D))
        return x_BTD + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x_BTD))))


class GPT(nn.Module):
    """Decoder-only transformer. `forward(idx, targets)` returns the mean cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Tied input/output embeddings for the byte vocabulary (saves V*D parameters, which are
        # most of a nano model); the 32k-vocabulary preset keeps an untied head like the paper.
        self.head = None
        if cfg.vocab_size > 256:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2: scale residual projections by 1/sqrt(2 * layers) so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn_out.weight", "mlp_out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, idx_BT: torch.Tensor) -> torch.Tensor:
        B, T = idx_BT.shape
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.tok_emb(idx_BT) + self.pos_emb(pos_T)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        x_BTD = self.ln_f(x_BTD)
        weight_VD = self.head.weight if self.head is not None else self.tok_emb.weight
        return x_BTD @ weight_VD.T

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        B, T = idx_BT.shape
        logits_BTV = self.logits(idx_BT)
        return F.cross_entropy(logits_BTV.reshape(B * T, -1), targets_BT.reshape(B * T))
